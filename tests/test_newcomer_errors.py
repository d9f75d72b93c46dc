"""Issue 51's newcomer cases at the Python API: each a clear error naming the value (not an AttributeError,
ZeroDivisionError or a silent reinterpretation), leaving nothing behind."""
import pytest

from ulacache_jax import generate
from ulacache_jax.runtime.engine import Engine
from ulacache_jax.runtime.requests import SamplingParams
from cache_steps import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("bad, message", [
    (None, r"model = None must be a loaded model"),
    ("smollm2-135m", r"model = 'smollm2-135m' must be a loaded model .*from_pretrained\('smollm2-135m'\)"),
    ("/tmp", r"model = '/tmp' must be a loaded model"),
])
def test_generate_and_engine_refuse_a_model_name(bad, message):
    with pytest.raises(TypeError, match=message):
        generate(bad, [[1, 2, 3]], max_new_tokens=2)
    if bad is None:      # Engine(None): neither a model nor a generator
        with pytest.raises(ValueError, match="give exactly one of model or generator"):
            Engine(bad)
    else:
        with pytest.raises(TypeError, match=message.replace("model =", "Engine: model =")):
            Engine(bad)


def test_tp_and_speculative_types(model):
    for tp in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match=r"tp = .* must be an int >= 1"):
            generate(model, [[1, 2, 3]], max_new_tokens=2, tp=tp)
    with pytest.raises(TypeError, match=r"speculative = 'ngram' must be None or a SpecConfig"):
        generate(model, [[1, 2, 3]], max_new_tokens=2, speculative="ngram")
    with pytest.raises(TypeError, match=r"speculative = 'ngram' must be None or a SpecConfig"):
        Engine(model, speculative="ngram")


@pytest.mark.parametrize("kw, message", [
    (dict(seed=4294967301), r"seed = 4294967301 must be None or an int in \[0, 2\*\*32\)"),
    (dict(seed=-1), r"seed = -1 must be None or an int in \[0, 2\*\*32\)"),
    (dict(temperature=float("inf")), r"temperature = inf must be a finite number >= 0"),
])
def test_sampling_params_refuse_what_would_be_reinterpreted(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw).check(256)


def test_stop_strings_without_a_tokenizer_fail_the_request(model):
    """An Engine without a tokenizer cannot match stop strings: the request fails with a message, the others run."""
    eng = Engine(model, max_seqs=2, max_context=64)
    bad = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2, stop=("a",)))
    good = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.get(bad).finish_reason == "error" and "need the engine's tokenizer" in eng.get(bad).error
    assert eng.get(good).finish_reason == "length" and len(eng.get(good).tokens) == 2
    assert eng.occupancy()["slots_used"] == 0


def test_cli_cases_are_one_line_errors_before_loading(tmp_path):
    """The real command, in subprocesses: --tp beyond the devices, a --draft-model that does not exist,
    --num-speculative-tokens without --speculative: exit 2, one line naming the option, no output file; and a
    preset as the draft model (as --help says) runs."""
    import json
    from test_cli_safety import ARGS, _cmd, _run_all
    inp = tmp_path / "p.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt_ids": [1, 2, 3]}) + "\n")
    cases = [(["--tp", "2"], "--tp 2: tp = 2 needs 2 devices but only 1"),
             (["--speculative", "draft", "--draft-model", "nosuch"], "--draft-model 'nosuch': no such file"),
             (["--num-speculative-tokens", "3"], "--num-speculative-tokens 3 needs --speculative")]
    cmds = [_cmd("--input", str(inp), "--output", str(tmp_path / f"o{i}.jsonl"), *extra, *ARGS)
            for i, (extra, _) in enumerate(cases)]
    cmds.append(_cmd("--input", str(inp), "--output", str(tmp_path / "draft.jsonl"), "--speculative", "draft",
                     "--draft-model", "tiny", *ARGS))
    got = _run_all(cmds)
    for i, ((rc, _, err), (_, msg)) in enumerate(zip(got, cases)):
        assert rc == 2 and msg in err and "Traceback" not in err, err
        assert len([x for x in err.splitlines() if "error" in x]) == 1, err
        assert not (tmp_path / f"o{i}.jsonl").exists()
    rc, _, err = got[-1]
    assert rc == 0, err
    (row,) = [json.loads(x) for x in (tmp_path / "draft.jsonl").read_text().splitlines()]
    assert row["finish_reason"] == "length" and len(row["token_ids"]) == 8
