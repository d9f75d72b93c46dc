"""Built-in long prompts for `make demo`: long-context tasks (retrieval from a ledger, a log, a manual, a story)
of about 1.2K to 3.7K bytes, i.e. byte tokens for the tiny preset. Deterministic (a seeded generator, no files,
no downloads). With the tiny preset's random weights the answers are gibberish; what the demo shows is the cache
at work: prompts far longer than the token budget, so selection, the PB-LRU and the host tier all run."""
from __future__ import annotations

import random

_CITIES = ("Lisbon", "Osaka", "Quito", "Tallinn", "Accra", "Hobart", "Bergen", "Cusco", "Dakar", "Gdansk", "Hue",
           "Izmir", "Jaipur", "Kigali", "Leon", "Malmo", "Nantes", "Oulu", "Perth", "Riga", "Split", "Tartu")
_ITEMS = ("brass compass", "tide table", "signal lamp", "copper kettle", "field radio", "star chart", "rope ladder",
          "wool blanket", "tin lantern", "oak chest", "glass float", "spare sail")
_SERVICES = ("auth", "billing", "search", "upload", "mailer", "scheduler", "gateway", "reports")
_MANUAL = (
    "The pump must be primed before the first start of the season. Open the bleed valve, fill the housing with "
    "clean water until it overflows, then close the valve by hand without tools.",
    "Never run the pump dry for more than thirty seconds; the seal heats quickly and a scored seal leaks at every "
    "later start. If the outlet pressure stays below one bar, stop and prime again.",
    "The strainer basket collects leaves and grit. Check it weekly in autumn and monthly otherwise. A clogged "
    "basket shows as a rising inlet vacuum and a falling flow on the front gauge.",
    "Winter storage: drain the housing through the lower plug, remove the strainer basket, and store the pump "
    "indoors above freezing. Water left in the housing cracks it when it freezes.",
    "Fault code E3 means the motor drew too much current at start. Check for a blocked impeller before resetting; "
    "three E3 faults in an hour lock the controller until it is power cycled.",
    "Fault code E7 means the float switch reports a dry sump. The controller retries every ten minutes and stops "
    "retrying after six attempts, which protects the seal described above.",
)
_STORY = (
    "The keeper of the north light kept two logbooks: one for the ships, one for the weather, and she never "
    "mixed them, not even on the night the fog came in so thick that the beam stopped at the rail.",
    "Her brother rowed out every Sunday with bread, oil for the lamp, and whatever news the harbour had decided "
    "was true that week. Most weeks it was about the price of herring; some weeks it was about her.",
    "In the spring a surveyor arrived with a brass compass and a stack of charts that disagreed with each other. "
    "He stayed for eleven days, measured everything twice, and left the charts behind when he went.",
    "She used the back of the worst chart to write down the names of every ship that passed in a storm, and the "
    "time it passed, and whether it answered her lamp. Three never answered. She underlined those.",
)


def _ledger(rng: random.Random, target: int) -> str:
    head = "Ledger of the harbour stores. Each entry records where an item was left and its locker code.\n"
    lines, n = [], 0
    while len(head) + sum(map(len, lines)) < target - 120:
        n += 1
        lines.append(f"Entry {n:03d}: the {rng.choice(_ITEMS)} was left in {rng.choice(_CITIES)}, locker code "
                     f"{rng.randrange(1000, 9999)}.\n")
    pick = rng.randrange(len(lines))
    item = lines[pick].split("the ", 1)[1].split(" was")[0]
    city = lines[pick].split("left in ", 1)[1].split(",")[0]
    return head + "".join(lines) + f"\nQuestion: what is the locker code of the {item} left in {city}?\nAnswer:"


def _log(rng: random.Random, target: int) -> str:
    head = "Service log, one request a line. Exactly one request failed; find it.\n"
    lines, t = [], 0
    while len(head) + sum(map(len, lines)) < target - 100:
        t += rng.randrange(1, 40)
        lines.append(f"12:{t // 60 % 60:02d}:{t % 60:02d} {rng.choice(_SERVICES):>9} req={rng.randrange(16**6):06x} "
                     f"status=200 ms={rng.randrange(3, 900)}\n")
    bad = rng.randrange(len(lines))
    lines[bad] = lines[bad].replace("status=200", "status=503")
    return head + "".join(lines) + "\nQuestion: which request id failed, and in which service?\nAnswer:"


def _paragraphs(rng: random.Random, target: int, parts, head: str, question: str) -> str:
    out = [head]
    while sum(map(len, out)) < target - len(question) - 2:
        out.append(rng.choice(parts) + "\n")
    return "".join(out) + "\n" + question


def demo_prompts() -> list[dict]:
    """-> JSONL-ready records {"id", "prompt", "max_new_tokens"}: six prompts of 1.2K-3.7K bytes, with different
    generation lengths so that requests finish at different times and queued ones take their slots."""
    rng = random.Random(2026)
    return [
        {"id": "ledger-3k", "prompt": _ledger(rng, 3000), "max_new_tokens": 128},
        {"id": "log-2k", "prompt": _log(rng, 2000), "max_new_tokens": 64},
        {"id": "manual-3.7k", "prompt": _paragraphs(rng, 3700, _MANUAL, "Pump manual, excerpts.\n",
                                                    "Question: what does fault code E7 mean, and when does the "
                                                    "controller stop retrying?\nAnswer:"), "max_new_tokens": 192},
        {"id": "story-1.2k", "prompt": _paragraphs(rng, 1200, _STORY, "From a lighthouse keeper's notes.\n",
                                                   "Question: how many ships never answered her lamp?\nAnswer:"),
         "max_new_tokens": 96},
        {"id": "ledger-1.8k", "prompt": _ledger(rng, 1800), "max_new_tokens": 160},
        {"id": "log-3.4k", "prompt": _log(rng, 3400), "max_new_tokens": 128},
    ]
