"""The OpenAI body parser and response shapes (app/openai_protocol.py) and the streaming detokenizer
(app/detokenize.py): pure functions, no model."""
import dataclasses

import pytest

from ulacache_jax.app import openai_protocol as proto
from ulacache_jax.app.detokenize import Detokenizer, held_suffix
from ulacache_jax.models import ByteTokenizer
from ulacache_jax.runtime.requests import SamplingParams

CHAT = [{"role": "user", "content": "hi"}]
HAVE = proto.engine_sampling_fields()


def chat(**kw):
    return proto.parse_body({"messages": CHAT, **kw}, proto.CHAT, vocab_size=258)


def completion(**kw):
    return proto.parse_body({"prompt": "hello", **kw}, proto.COMPLETION, vocab_size=258)


def refused(fn, param, text, status=400, **kw):
    with pytest.raises(proto.ApiError) as e:
        fn(**kw)
    assert e.value.status == status
    assert e.value.param == param, e.value.message
    assert text in e.value.message
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["param"] == param


def test_chat_fields_map_to_sampling():
    r = chat(model="m", max_completion_tokens=7, temperature=0.5, top_p=0.9, top_k=5, seed=3, stop=["a", "b"],
             n=2, user="u", stream=True, stream_options={"include_usage": True}, metadata=None, tools=None,
             logit_bias={}, response_format={"type": "text"})
    assert (r.kind, r.model, r.n, r.stream, r.include_usage) == (proto.CHAT, "m", 2, True, True)
    sp = r.sampling
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop) == (7, 0.5, 0.9, 5, 3,
                                                                                         ("a", "b"))
    assert r.prompts == ([{"role": "user", "content": "hi"}],)


def test_openai_nulls_are_defaults():
    d = proto.Defaults(base=SamplingParams(max_new_tokens=33, stop_ids=(9,), stop=("END",)))
    r = proto.parse_body({"messages": CHAT, "max_tokens": None, "temperature": None, "top_p": None, "stop": None,
                          "seed": None, "n": None, "logprobs": None, "top_logprobs": None, "stream": None,
                          "presence_penalty": None, "min_p": None, "attention": None, "token_budget": None},
                         proto.CHAT, d, vocab_size=258)
    assert r.sampling == SamplingParams(max_new_tokens=33, stop_ids=(9,), stop=("END",))
    assert proto.parse_body({"messages": CHAT, "ignore_eos": True}, proto.CHAT, d).sampling.stop_ids == ()
    assert (r.n, r.stream, r.logprobs) == (1, False, None)


def test_bad_fields_are_named():
    refused(chat, "temperature", "'temperature' = 3", temperature=3)
    refused(chat, "top_p", "top_p", top_p=0)
    refused(chat, "max_tokens", "max_tokens", max_tokens=0)
    refused(chat, "max_tokens", "integer", max_tokens="12")
    refused(chat, "n", "'n'", n=0)
    refused(chat, "stop", "empty", stop=[""])
    refused(chat, "stop", "at most 4", stop=list("abcde"))
    refused(chat, "top_k", "top_k", top_k=10**6)
    refused(chat, "colour", "unknown field 'colour'", colour="red")
    refused(chat, "tools", "tool calls", tools=[{"type": "function"}])
    refused(chat, "logit_bias", "logit biases", logit_bias={"1": 5})
    refused(chat, "stream_options", "stream", stream_options={"include_usage": True})
    refused(chat, "top_logprobs", "needs 'logprobs'", top_logprobs=2)
    refused(chat, "max_completion_tokens", "disagree", max_tokens=3, max_completion_tokens=4)
    refused(chat, "attention", "sparse", attention="fast")
    refused(completion, "echo", "echo", echo=True)
    refused(completion, "logprobs", "'logprobs'", logprobs=6)
    refused(completion, "prompt", "'prompt'", prompt=[])
    refused(completion, "prompt", "empty string", prompt="")
    with pytest.raises(proto.ApiError, match="JSON object"):
        proto.parse_body([1, 2], proto.CHAT)
    with pytest.raises(proto.ApiError) as e:
        proto.parse_body({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, proto.CHAT)
    assert e.value.param == "messages[0].content"


def test_contract_fields_refused_only_when_the_engine_lacks_them():
    """Each field of the shared SamplingParams contract: passed through where the engine has it, else refused
    naming it unless the body gives its default (so this parser works before and after that change)."""
    values = {"min_p": 0.2, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.3,
              "attention": "dense", "token_budget": 64}
    for name, v in values.items():
        if name in HAVE:
            assert getattr(chat(**{name: v}).sampling, name) == v
        else:
            refused(chat, name, f"'{name}' is not supported by this engine", **{name: v})
            assert chat(**{name: proto.CONTRACT_DEFAULTS[name]}).sampling == chat().sampling
    if "logprobs" in HAVE:
        assert chat(logprobs=True, top_logprobs=3).sampling.logprobs == 3
        assert completion(logprobs=0).sampling.logprobs == 0
    else:
        refused(chat, "logprobs", "not supported by this engine", logprobs=True)
        assert chat(logprobs=False).logprobs is None


def test_token_budget_capped_by_the_engine():
    d = proto.Defaults(max_token_budget=128)
    with pytest.raises(proto.ApiError) as e:
        proto.parse_body({"messages": CHAT, "token_budget": 256}, proto.CHAT, d)
    assert e.value.param == "token_budget" and "128" in e.value.message


def test_completion_prompt_forms():
    assert completion(prompt=[1, 2, 3]).prompts == ([1, 2, 3],)
    assert completion(prompt=["a", "b"]).prompts == ("a", "b")
    assert completion(prompt=[[1], [2, 3]]).prompts == ([1], [2, 3])


def test_choice_seeds_are_distinct_and_choice_zero_keeps_the_seed():
    r = chat(n=4, seed=11)
    seeds = [r.choice_sampling(i).seed for i in range(4)]
    assert seeds[0] == 11 and len(set(seeds)) == 4
    assert all(0 <= s < 2**32 for s in seeds)
    assert [chat(n=3).choice_sampling(i).seed for i in range(3)] == [None] * 3   # the engine derives distinct ones
    assert proto.derive_seed(1, 1) != proto.derive_seed(2, 1)


def test_response_shapes():
    use = proto.usage(3, 4)
    assert use == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    r = proto.chat_response("id", 1, "m", [{"index": 0, "text": "hi", "finish_reason": "stop"}], use)
    assert r["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and r["object"] == "chat.completion"
    c = proto.chat_chunk("id", 1, "m", 0, role=True, content="")
    assert c["choices"][0]["delta"] == {"role": "assistant", "content": ""} and "usage" not in c
    assert proto.usage_chunk("id", 1, "m", proto.CHAT, use)["choices"] == []
    lp = proto.logprobs_completion([("a", -0.1, [("a", -0.1), ("b", -2.0)]), ("bc", -0.5, [])], text_offset=5)
    assert lp["text_offset"] == [5, 6] and lp["top_logprobs"][0] == {"a": -0.1, "b": -2.0}
    lc = proto.logprobs_chat([("é", -0.1, [("é", -0.1)])])
    assert lc["content"][0]["bytes"] == [0xC3, 0xA9]


# ---- detokenizer -------------------------------------------------------------------------------------------------
def stream(text_ids, stops=(), step=1, final=None):
    tok = ByteTokenizer()
    d = Detokenizer(tok, stops)
    out = []
    for i in range(0, len(text_ids), step):
        out.append(d.push(text_ids[i:i + step]))
    out.append(d.finish(final if final is not None else tok.decode(text_ids)))
    return out


def test_detokenizer_never_splits_a_character():
    ids = list("naïve → 日本 🎉!".encode())
    pieces = stream(ids)
    assert "".join(pieces) == "naïve → 日本 🎉!"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xF0)] == ""          # the emoji's first byte alone shows nothing


def test_detokenizer_holds_back_a_possible_stop_string():
    tok = ByteTokenizer()
    ids = list(b"abc STOP")
    d = Detokenizer(tok, ["STOP"])
    sent = "".join(d.push([t]) for t in ids[:7])      # "abc STO": "STO" could start the stop string
    assert sent == "abc "
    # the Engine ends the request at the token completing "STOP" and cuts its text before it
    assert sent + d.finish("abc ") == "abc "
    d = Detokenizer(tok, ["STOP"])
    assert "".join(d.push([t]) for t in b"ST") == ""
    assert d.push(list(b"x")) == "STx"                 # not the stop string after all: released


def test_detokenizer_last_tokens_completing_a_stop_string_are_not_sent():
    """The Engine's last delivery can hold the whole stop string at once: finish() sends only the Engine's text."""
    tok = ByteTokenizer()
    d = Detokenizer(tok, ["VT"])
    assert d.push(list(b"ab")) == "ab"
    assert d.finish("abx$", list(b"x$VT")) == "x$"
    d = Detokenizer(tok, ["VT"])
    assert d.push(list(b"abVTc")) == "ab"              # a whole stop string is never passed, even mid-stream


def test_held_suffix():
    assert held_suffix("abc ST", ["STOP", "Tx"]) == 2
    assert held_suffix("abc", ["STOP"]) == 0
    assert held_suffix("abc", []) == 0


def test_detokenizer_deltas_equal_the_whole_text_in_chunks():
    ids = list("Grüße aus Köln".encode())
    for step in (1, 2, 3, 7):
        assert "".join(stream(ids, step=step)) == "Grüße aus Köln"


def test_api_request_is_frozen():
    r = chat()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.n = 3
