"""Python API argument checks (ulacache_jax/runtime/validate.py): the cases of issue 23 that generate() coerced or let
fail inside jax, each now a clear error naming the value and the limit."""
import numpy as np
import pytest

from ulacache_jax.runtime import validate as v

V = 258


def test_float_ids_refused_not_truncated():
    with pytest.raises(TypeError, match=r"prompt_ids\[0\]\[0\] is float 1.7.*must be ints"):
        v.check_prompt_batch([[1.7, 2.2]], V)
    with pytest.raises(TypeError, match="float"):
        v.check_prompt_batch([[1.0, 2]], V)                  # even integral floats: no silent coercion
    with pytest.raises(TypeError, match="dtype float"):
        v.check_prompt_batch(np.array([[1.5, 2.0]]), V)
    with pytest.raises(TypeError, match="bool"):
        v.check_prompt_batch([[True, 2]], V)


def test_flat_list_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"flat list of 3 ints.*3 one-token prompts.*\[\[256, 72, 101\]\]"):
        v.check_prompt_batch([256, 72, 101], V)
    with pytest.raises(ValueError, match="1-D array of 3 ids"):
        v.check_prompt_batch(np.array([256, 72, 101]), V)


def test_good_batches_normalized():
    assert v.check_prompt_batch([[256, 72], [1]], V) == [[256, 72], [1]]
    assert v.check_prompt_batch(np.array([[1, 2], [3, 4]], np.int32), V) == [[1, 2], [3, 4]]
    assert v.check_prompt_batch([np.array([5, 6]), (7,)], V) == [[5, 6], [7]]
    out = v.check_prompt_batch([[np.int64(3)]], V)
    assert out == [[3]] and type(out[0][0]) is int


@pytest.mark.parametrize("bad, err, msg", [
    ("hello", TypeError, "tokenize"), ([], ValueError, "empty"), ([[]], ValueError, r"prompt_ids\[0\] is empty"),
    ([[1, 258]], ValueError, r"= 258 is outside \[0, vocab_size = 258\)"), ([[1, -1]], ValueError, "outside"),
    ([[[1, 2]]], TypeError, "nested"), ([["a"]], TypeError, "must be ints"), (5, TypeError, "list of token-id"),
    (np.zeros((1, 2, 3), np.int32), ValueError, "shape"), ([[1], "ab"], TypeError, "tokenize"),
])
def test_bad_prompts(bad, err, msg):
    with pytest.raises(err, match=msg):
        v.check_prompt_batch(bad, V)


def test_stop_ids():
    assert v.check_stop_ids([1, np.int32(2)], V) == (1, 2)
    assert v.check_stop_ids(257, V) == (257,) and v.check_stop_ids(None, V) == () and v.check_stop_ids((), V) == ()
    with pytest.raises(ValueError, match=r"stop id 99999 is outside \[0, vocab_size = 258\).*never"):
        v.check_stop_ids([99999], V)
    with pytest.raises(TypeError, match=r"string.*token ids.*tokenizer.encode"):
        v.check_stop_ids("\n", V)
    with pytest.raises(TypeError, match="must be an int"):
        v.check_stop_ids([1.0], V)


def test_seed():
    assert v.check_seed(0) == 0 and v.check_seed(np.uint32(7)) == 7 and v.check_seed(2**32 - 1) == 2**32 - 1
    with pytest.raises(TypeError, match=r"seed = None.*default is 0"):
        v.check_seed(None)
    for bad, err in ((1.5, TypeError), ("3", TypeError), (True, TypeError), (-1, ValueError), (2**32, ValueError)):
        with pytest.raises(err, match="seed"):
            v.check_seed(bad)


def test_sampling_and_max_new_tokens():
    assert v.check_sampling_args(0, 1, 0, V) == (0.0, 1.0, 0)
    assert v.check_sampling_args(np.float32(0.5), 0.9, np.int64(5), V) == (0.5, pytest.approx(0.9), 5)
    for args, msg in (((-1, 1, 0), "temperature"), (("0.5", 1, 0), "number"), ((float("nan"), 1, 0), "finite"),
                      ((0, 0, 0), "top_p"), ((0, 1.5, 0), "top_p"), ((0, 1, 2.0), "top_k"), ((0, 1, 259), "top_k"),
                      ((True, 1, 0), "number")):
        with pytest.raises((TypeError, ValueError), match=msg):
            v.check_sampling_args(*args, V)
    assert v.check_max_new_tokens(np.int32(3)) == 3
    for bad in (0, 2.0, None, True):
        with pytest.raises(ValueError, match="max_new_tokens"):
            v.check_max_new_tokens(bad)


def test_check_generate_args_all_at_once():
    got = v.check_generate_args([[256, 72]], V, max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=3, seed=1,
                                stop_ids=[257])
    assert got == {"prompts": [[256, 72]], "max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 3,
                   "seed": 1, "stop_ids": (257,)}
    with pytest.raises(ValueError, match="flat list"):
        v.check_generate_args([256, 72, 101], V, max_new_tokens=4)
