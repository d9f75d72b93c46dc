"""Cross-layer reuse of page scores (ulacache_jax/cache/select/reuse.py): listing every layer is the inner rule
exactly; listing layer 0 alone makes every layer select layer 0's pages (recorded per layer by the teacher-forced
scorer); a covering budget gives dense attention's tokens; bad layer lists, nesting and speculative verification
are refused by name; its bytes are the inner rule's at the listed layers."""
import dataclasses

import numpy as np
import pytest

from ulacache_jax.cache.select import reuse
from ulacache_jax.cache.select.labels import Labels
from ulacache_jax.cache.select.quest import Quest
from ulacache_jax.runtime.generation import default_cache_config, generate
from cache_steps import assert_covering_budget_equals_dense, tiny_model
from scripts.scoring import TeacherForcedScorer


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def prompts(n=2):
    rng = np.random.default_rng(0)
    return [list(map(int, rng.integers(0, 256, 150))) for _ in range(n)]


def cache(model, **kw):
    # budget 6 pages of 16 among ~10 (sink 1 and recent 2 of them forced): selection matters
    return default_cache_config(model.config, num_seqs=2, max_tokens=200, page_size=16, token_budget=96,
                                dtype="float32", **kw)


@pytest.mark.parametrize("labels", [False, True], ids=["quest", "labels"])
def test_every_layer_listed_is_the_inner_rule(model, labels):
    kw = dict(key_channels=8, label_bits=4) if labels else {}
    base = cache(model, **kw)
    every = reuse.configure(base, tuple(range(model.config.num_layers)))
    assert isinstance(every.selection, reuse.Reuse)
    assert isinstance(every.selection.inner, Labels if labels else Quest)
    ps = prompts()
    assert generate(model, ps, max_new_tokens=17, cache_config=every, attention="sparse") == \
        generate(model, ps, max_new_tokens=17, cache_config=base, attention="sparse")


def test_layer_zero_alone_selects_for_every_layer(model):
    """Each layer attends its own K/V at the pages layer 0 chose (the same ids in every layer), and the run is not
    the inner rule's (layer 1 would have chosen other pages)."""
    cc = reuse.configure(cache(model, key_channels=8, label_bits=4), (0,))
    ws = [p + [7] * 40 for p in prompts()]
    res = TeacherForcedScorer(model, cc, record=True).score(ws, 150)
    sel = res.selections                                                      # [steps, L, W, G, K]
    assert (sel >= 0).any() and sel.shape[1] == model.config.num_layers
    for layer in range(1, sel.shape[1]):
        np.testing.assert_array_equal(sel[:, layer], sel[:, 0])
    own = TeacherForcedScorer(model, cache(model, key_channels=8, label_bits=4), record=True).score(ws, 150)
    assert not np.array_equal(own.selections[:, 1], own.selections[:, 0])     # the tiny model's layers differ


def test_covering_budget_equals_dense(model):
    base = default_cache_config(model.config, num_seqs=2, max_tokens=128, page_size=16)
    assert_covering_budget_equals_dense(model, selection=reuse.configure(base, (0,)).selection)


def test_refusals(model):
    base = cache(model)
    L = model.config.num_layers
    for bad in [(), (1,), (0, 0), (1, 0), (0, L), (0, True)]:
        with pytest.raises(ValueError, match="Reuse: layers"):
            reuse.configure(base, bad)
    rule = reuse.Reuse(Quest(), (0,))
    with pytest.raises(ValueError, match="other than Reuse"):
        dataclasses.replace(base, selection=reuse.Reuse(rule, (0,)))
    with pytest.raises(ValueError, match="verify_rows = 4"):
        dataclasses.replace(base, selection=rule, verify_rows=4)
    for spec in ["every:0", "x", "1,2", "0,0", f"0,{L}", ""]:
        with pytest.raises(ValueError, match="--reuse-layers"):
            reuse.parse_spec(spec, L)
    assert reuse.parse_spec("every:2", 5) == (0, 2, 4) and reuse.parse_spec("0,3", 5) == (0, 3)


def test_bytes_are_the_inner_rules_at_the_listed_layers():
    shape = dict(context=131072, kv_heads=8, head_dim=128, itemsize=2, page_size=64)
    inner = Labels(channels=32, bits=4)
    r = reuse.Reuse(inner, (0, 8, 16, 24))
    assert r.step_bytes(num_layers=32, **shape) == pytest.approx(inner.step_bytes(num_layers=32, **shape) / 8)
    assert r.kernel_bytes(num_layers=32, **shape) == pytest.approx(inner.kernel_bytes(num_layers=32, **shape) / 8)
