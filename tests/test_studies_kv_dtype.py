"""scripts/studies/kv_dtype_quality.py's per-token fp8 codec (issue 50's alternative to a scale per page): each
token's values are e4m3 codes under that token's own scale per KV head, whatever the rest of the page holds."""
import jax
import jax.numpy as jnp
import numpy as np

from scripts.studies.kv_dtype_quality import cache_fields, per_token_fp8_codec
from ulacache_jax.cache import codec


def test_per_token_codec_is_one_scale_per_token_and_head():
    c = per_token_fp8_codec()
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 16, 2, 8)) * (jnp.arange(1, 17) ** 3.0)[None, :, None, None]
    got = c.encode(x, x, jnp.float32)
    assert got.ks is None and got.k.dtype == jnp.float32 and not c.scaled and c.ring_in_pool
    fp8 = codec.Fp8Codec()
    for t in (0, 7, 15):                 # a page of one token through the per-page codec: the same values
        one = x[:, t:t + 1]
        want = fp8.decode(fp8.encode(one, one, jnp.float32), jnp.float32)[0][:, 0]
        np.testing.assert_array_equal(np.asarray(got.k[:, t]), np.asarray(want))
    y = x.at[:, 5, 1].mul(1e4)            # another token's (and head's) magnitude changes nothing here
    np.testing.assert_array_equal(np.asarray(c.encode(y, y, jnp.float32).k[:, 0]), np.asarray(got.k[:, 0]))
    assert float(jnp.abs(got.k - x).max() / jnp.abs(x).max()) < 2**-4
    assert cache_fields("fp8_per_token")["page_codec"] == c and cache_fields("auto") == {"kv_dtype": "auto"}
