"""CacheConfig: the frozen shape of a UlaCache (DESIGN.md section 3), validated on construction, with presets."""
from __future__ import annotations

import dataclasses

import numpy as np
import jax
import jax.numpy as jnp

from ulacache_jax.cache import codec as codec_mod
from ulacache_jax.cache import lid as lid_mod
from ulacache_jax.cache.select import registry
from ulacache_jax.cache.select.rule import SelectionRule

TAIL_PAGES = 2  # ring pages per (seq, layer, group): a decode chunk of page_size steps crosses <= 1 page boundary


def _static_object(name: str, value, cls: type, home: str) -> None:
    """A config field holding an object (a selection rule, a page codec): an instance of `cls`, and hashable, since
    the config is a static jit field."""
    if not isinstance(value, cls):
        raise ValueError(f"CacheConfig: {name} = {value!r} must be a {cls.__name__} ({home})")
    try:
        hash(value)
    except TypeError as e:
        raise ValueError(f"CacheConfig: {name} {value!r} must be hashable (a frozen dataclass): it is a static jit "
                         f"field ({e})") from None


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Shapes and policy of one cache. Counts are per rank unless named otherwise.

    Attended pages per (sequence, group) each step: `select_pages = token_budget // page_size` pages chosen among
    the flushed pages (the first `sink_pages` and last `recent_pages` always, the rest by Quest score), plus the
    unflushed tail pages (at most TAIL_PAGES, read from the HBM tail ring). A sequence of at most `select_pages`
    flushed pages selects all of them, so sparse equals dense there exactly."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_seqs: int = 8
    max_pages_per_seq: int = 64
    page_size: int = 64
    kv_heads_per_group: int = 1
    dtype: str = "bfloat16"
    num_buckets: int = 64
    slots_per_bucket: int = 64
    host_pages: int = 4096           # host pool capacity in (layer, group) pages, per rank
    token_budget: int = 2048
    sink_pages: int = 1
    recent_pages: int = 2
    tp: int = 1                      # ranks of the head-sharded mesh axis
    verify_rows: int = 1             # query rows per sequence one call attends: 1 + speculative drafts (overflow frames)
    summary_split: int = 1           # key summaries per page (each over page_size // summary_split tokens); a page
                                     # scores the max of its sub-pages' Quest bounds, selection stays per page
    key_channels: int = 0            # 0: Quest selection. C > 0: an HBM copy of C channels of every flushed key
                                     # scores pages by approximate attention mass instead (key_copy.py)
    label_bits: int = 0              # 0: the copy in the model's dtype, channels of largest key energy (key copy).
                                     # 8 or 4: label channels (select/labels.py): whole rotary pairs, int8 / int4
                                     # codes with a scale per page and channel
    channel_table: tuple | None = None  # labels' offline calibration: [num_layers][num_kv_heads][C] channel ids
                                        # (scripts/calibrate_labels.py); None: each prompt's first tokens (online)
    selection: SelectionRule | None = None  # None: the built-in rule the fields above name (quest / key_copy /
                                            # labels); a rule object (select/rule.py): that rule (select/registry.py)
    kv_dtype: str = "auto"           # the page format (cache/codec.py): "auto" = the model's dtype (`dtype`), or
                                     # "float8_e4m3fn" = e4m3 codes with a float32 scale per page and KV head
    page_codec: codec_mod.ModelCodec | None = None  # a codec object instead of kv_dtype's (e.g. a test's own)
    token_shortlist: int = 0         # 0: the budget attends whole pages. M >= 1: per-token selection: M x the
                                     # budget's pages are selected (the pool's unit, `shortlist_pages`) and the
                                     # budget's tokens of largest estimated mass among theirs are attended (a rule
                                     # with per-token scores: the key copy or labels; decode_layer.token_list)

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ValueError(f"CacheConfig: {msg}")

        for f in ("num_layers", "num_kv_heads", "head_dim", "max_seqs", "max_pages_per_seq", "page_size",
                  "kv_heads_per_group", "num_buckets", "slots_per_bucket", "host_pages", "token_budget", "tp",
                  "verify_rows"):
            v = getattr(self, f)
            need(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1, f"{f} = {v!r} must be an int >= 1")
        for f in ("sink_pages", "recent_pages"):
            v = getattr(self, f)
            need(isinstance(v, int) and v >= 0, f"{f} = {v!r} must be an int >= 0")
        need(self.num_kv_heads % self.kv_heads_per_group == 0,
             f"num_kv_heads = {self.num_kv_heads} must be a multiple of kv_heads_per_group = {self.kv_heads_per_group}")
        need(self.num_groups <= lid_mod.FIELD_LIMITS["group"],
             f"num_groups = {self.num_groups} exceeds {lid_mod.FIELD_LIMITS['group']} (4-bit LID group field); "
             "raise kv_heads_per_group")
        need(self.num_layers <= lid_mod.FIELD_LIMITS["layer"], f"num_layers = {self.num_layers} exceeds 256")
        need(self.max_seqs <= lid_mod.FIELD_LIMITS["seq"], f"max_seqs = {self.max_seqs} exceeds 2**20")
        need(self.page_size & (self.page_size - 1) == 0, f"page_size = {self.page_size} must be a power of two")
        sp = self.summary_split
        need(isinstance(sp, (int, np.integer)) and not isinstance(sp, bool) and sp >= 1 and sp & (sp - 1) == 0
             and sp <= self.page_size,
             f"summary_split = {sp!r} must be a power of two >= 1 dividing page_size = {self.page_size} (at most "
             f"{self.page_size})")
        kc = self.key_channels
        need(isinstance(kc, (int, np.integer)) and not isinstance(kc, bool) and 0 <= kc <= self.head_dim,
             f"key_channels = {kc!r} must be an int in [0, head_dim = {self.head_dim}]")
        lb = self.label_bits
        need(lb in (0, 4, 8) and not isinstance(lb, bool), f"label_bits = {lb!r} must be 0, 4 or 8")
        need(not lb or (kc >= 2 and kc % 2 == 0 and self.head_dim % 2 == 0),
             f"label_bits = {lb} needs an even key_channels >= 2 (whole rotary pairs; it is {kc})")
        need(self.channel_table is None or lb, "channel_table is the labels' calibration: it needs label_bits 4 or 8")
        if self.channel_table is not None:
            tab = np.asarray(self.channel_table)
            if tab.ndim == 3:   # hashable and immutable, whatever sequence type it came as (a static jit field)
                object.__setattr__(self, "channel_table", tuple(tuple(tuple(int(c) for c in h) for h in l)
                                                                for l in tab.tolist()))
            need(tab.shape == (self.num_layers, self.num_kv_heads, kc) and tab.dtype.kind == "i"
                 and tab.min() >= 0 and tab.max() < self.head_dim,
                 f"channel_table shape {tab.shape} must be [num_layers, num_kv_heads, key_channels] = "
                 f"[{self.num_layers}, {self.num_kv_heads}, {kc}] of channel ids in [0, {self.head_dim})")
        if self.selection is not None:
            _static_object("selection", self.selection, SelectionRule, "ulacache_jax/cache/select/rule.py")
            need(not kc, f"selection = {self.selection!r} replaces the built-in rules: leave key_channels at 0")
            self.selection.check(self)
        need(self.max_pages_per_seq * self.page_size <= 2**31 - 1,
             f"max_pages_per_seq * page_size = {self.max_pages_per_seq * self.page_size} tokens exceeds 2**31 - 1")
        lid_mod.log2_buckets(self.num_buckets)
        need(self.num_frames < 2**31, f"num_frames = {self.num_frames} must be < 2**31")
        need(self.token_budget % self.page_size == 0,
             f"token_budget = {self.token_budget} must be a multiple of page_size = {self.page_size}")
        need(self.sink_pages + self.recent_pages <= self.select_pages,
             f"sink_pages + recent_pages = {self.sink_pages + self.recent_pages} exceeds token_budget // page_size"
             f" = {self.select_pages}")
        ts = self.token_shortlist
        need(isinstance(ts, (int, np.integer)) and not isinstance(ts, bool) and ts >= 0,
             f"token_shortlist = {ts!r} must be an int >= 0 (0: whole pages; M: tokens among M x the budget's pages)")
        if ts:
            need(self.selection_rule.tokens,
                 f"token_shortlist = {ts} ranks single tokens: the rule {self.rule!r} scores pages only (use "
                 "key_channels with or without label_bits)")
            need(self.kv_dtype == "auto" and self.page_codec is None,
                 f"token_shortlist = {ts} reads pages in the model's dtype: kv_dtype = {self.kv_dtype!r} (a scaled "
                 "page format) is not supported with it")
        need(self.dtype in ("bfloat16", "float32", "float16"), f"dtype = {self.dtype!r} must be bfloat16, float16 or float32")
        need(self.kv_dtype in codec_mod.KV_DTYPES, f"kv_dtype = {self.kv_dtype!r} must be one of {codec_mod.KV_DTYPES}")
        need(self.page_codec is None or self.kv_dtype == "auto",
             f"page_codec = {self.page_codec!r} replaces kv_dtype: leave kv_dtype at 'auto' (it is {self.kv_dtype!r})")
        if self.page_codec is not None:
            _static_object("page_codec", self.page_codec, codec_mod.ModelCodec, "ulacache_jax/cache/codec.py")
        self.codec.check(self.dtype)
        need(self.num_groups % self.tp == 0 or self.tp % self.num_groups == 0,
             f"num_groups = {self.num_groups} must divide or be divided by tp = {self.tp}")
        need(self.tp == 1 or self.num_groups % self.tp == 0,
             f"num_groups = {self.num_groups} % tp = {self.tp} != 0: replicate heads (kv_heads_per_group) first")

    # derived sizes
    @property
    def label_bytes(self) -> float:
        """Bytes of one channel of one token in the key copy: the model dtype's, or label_bits / 8."""
        return self.label_bits / 8 if self.label_bits else self.jnp_dtype.itemsize

    @property
    def selection_rule(self) -> SelectionRule:
        """The page-selection rule object (select/registry.resolve): `selection`, or the one the fields name."""
        return registry.resolve(self)

    @property
    def rule(self) -> str:
        """The page-selection rule's name: 'quest', 'key_copy' or 'labels' for the built-in rules (the row
        vocabulary of the benchmarks), a given rule's own `name` otherwise."""
        return self.selection_rule.name

    @property
    def num_groups(self) -> int:
        return self.num_kv_heads // self.kv_heads_per_group

    @property
    def groups_per_rank(self) -> int:
        return self.num_groups // self.tp

    @property
    def num_frames(self) -> int:
        return self.num_buckets * self.slots_per_bucket

    @property
    def select_pages(self) -> int:
        return self.token_budget // self.page_size

    @staticmethod
    def step_pages(select_pages: int, token_shortlist: int = 0) -> int:
        """Pages a (sequence, group) selects a step (the sieve's requests, the pool's working set): the budget's
        pages, or token_shortlist x them with per-token selection. A static rule so a pool can be sized before its
        config exists (default_cache_config)."""
        return select_pages * max(1, token_shortlist)

    @property
    def shortlist_pages(self) -> int:
        """`step_pages` of this config."""
        return self.step_pages(self.select_pages, self.token_shortlist)

    @property
    def summary_size(self) -> int:
        """Tokens under one key summary (a sub-page): page_size // summary_split."""
        return self.page_size // self.summary_split

    @property
    def summary_pages(self) -> int:
        """Key summaries per (sequence, layer, group): max_pages_per_seq * summary_split (sub-page p * split + h
        covers tokens [p * page_size + h * summary_size, ... + summary_size))."""
        return self.max_pages_per_seq * self.summary_split

    @property
    def overflow_frames(self) -> int:
        """HBM frames per rank that stage one layer call's overflow pages (misses with no free PB-LRU slot), so
        attention reads only HBM: at most every selected page of every sequence, group and query row overflows (a
        speculative verification attends `verify_rows` rows per sequence in one call, each with its own pages)."""
        return self.max_seqs * self.groups_per_rank * self.shortlist_pages * self.verify_rows

    @property
    def max_context(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def codec(self) -> codec_mod.ModelCodec:
        """The page format (cache/codec.py): `page_codec`, or the one `kv_dtype` names."""
        return codec_mod.codec_for(self.kv_dtype, self.page_codec)

    @property
    def storage_dtype(self):
        """The dtype of stored page codes (HBM frames, host pool): the model's, or the codec's."""
        return self.codec.storage_dtype(self.dtype)

    @property
    def page_bytes(self) -> int:
        """Bytes of one stored K (or V) page of one group: its codes and, for a scaled codec, its scales."""
        return self.codec.page_bytes(self.page_size, self.kv_heads_per_group, self.head_dim, self.dtype)

    @property
    def host_pool_bytes(self) -> int:
        """Bytes of one rank's host pool: host_pages K and V pages."""
        return 2 * self.host_pages * self.page_bytes

    @property
    def ring_page_bytes(self) -> int:
        """Bytes of one K (or V) page of one group in the tail ring: stored pages when the ring is in the pool,
        else the model's dtype (a scaled codec encodes a page at its flush, cache/codec.py)."""
        if self.codec.ring_in_pool:
            return self.page_bytes
        return self.page_size * self.kv_heads_per_group * self.head_dim * self.jnp_dtype.itemsize

    @property
    def ring_pages(self) -> int:
        """Tail-ring pages per rank: one per (seq, layer, group, ring slot)."""
        return self.max_seqs * self.num_layers * self.groups_per_rank * TAIL_PAGES

    @property
    def pool_pages(self) -> int:
        """Pages of the HBM pool per rank: the PB-LRU frames, the tail ring when it lives there, the overflow
        frames."""
        return self.num_frames + (self.ring_pages if self.codec.ring_in_pool else 0) + self.overflow_frames

    def footprint(self) -> dict[str, int]:
        """Bytes per rank of each pool, for capacity checks before anything is allocated. A given selection rule's
        state (`selection`) is counted under 'selection', from its `init` traced for shapes only."""
        isz = self.jnp_dtype.itemsize
        per_pg = self.num_layers * self.groups_per_rank * self.max_seqs
        extra = {}
        if self.selection is not None:
            shapes = jax.eval_shape(lambda: self.selection.init(self, 1))
            extra["selection"] = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes)))
        return extra | {
            "frames": 2 * self.num_frames * self.page_bytes,
            "tail": 2 * per_pg * TAIL_PAGES * self.ring_page_bytes,
            "overflow": 2 * self.overflow_frames * self.page_bytes,
            "summaries": 2 * per_pg * self.summary_pages * self.kv_heads_per_group * self.head_dim * isz,
            "key_copy": int(per_pg * self.kv_heads_per_group * self.key_channels * (
                self.max_context * self.label_bytes + 4 + (2 * self.max_pages_per_seq if self.label_bits else 0))),
            "vtlb": 2 * 4 * per_pg * self.max_pages_per_seq,
            "pb_lru": 12 * self.num_frames,
            "host": self.host_pool_bytes,
        }

    @classmethod
    def preset(cls, name: str, **overrides) -> "CacheConfig":
        presets = {
            # tiny shapes for CPU tests and the demo
            "tiny": dict(num_layers=2, num_kv_heads=2, head_dim=16, max_seqs=4, max_pages_per_seq=32, page_size=8,
                         num_buckets=4, slots_per_bucket=16, host_pages=1024, token_budget=64, dtype="float32"),
            # Llama-3.1-8B: 32 layers, 8 KV heads of 128; 256K context at page 64
            "llama-3.1-8b": dict(num_layers=32, num_kv_heads=8, head_dim=128, max_seqs=8, max_pages_per_seq=4096,
                                 num_buckets=256, slots_per_bucket=1024, host_pages=2**20, token_budget=2048),
            "llama-3.1-70b": dict(num_layers=80, num_kv_heads=8, head_dim=128, max_seqs=8, max_pages_per_seq=4096,
                                  num_buckets=256, slots_per_bucket=512, host_pages=2**20, token_budget=2048),
        }
        if name not in presets:
            raise ValueError(f"unknown CacheConfig preset {name!r}; known: {sorted(presets)}")
        return cls(**{**presets[name], **overrides})
