"""scripts/profile_decode.py's trace summary on a synthetic device timeline (the H200 run is what it is for)."""
import importlib.util
import pathlib

import pytest


@pytest.fixture(scope="module")
def prof():
    path = pathlib.Path(__file__).parent.parent / "scripts" / "profile_decode.py"
    spec = importlib.util.spec_from_file_location("profile_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _timeline(steps, layers):
    """Per layer-step: scores (2 us), topk (3 us, 1 us gap), attention (5 us, 2 us gap); 4 us between steps."""
    ev, t = [], 0.0
    for _ in range(steps):
        for l in range(layers):
            for name, d, gap in (("fusion.%d" % (3 * l), 2.0, 0.0), ("topk_kernel", 3.0, 1.0),
                                 ("attention_kernel", 5.0, 2.0)):
                t += gap
                ev.append(dict(ph="X", pid=1, tid=1, ts=t, dur=d, name=name))
                t += d
        t += 4.0
    return ev


def test_summary_counts_times_and_gaps(prof):
    steps, layers = 4, 3
    r = prof.summarize(_timeline(steps, layers), steps=steps, layers=layers)
    by = {o["name"]: o for o in r["ops"]}
    assert set(by) == {"fusion", "topk_kernel", "attention_kernel"}       # fusion.0/.3/.6 folded into one op
    assert by["attention_kernel"]["us_per_layer_step"] == pytest.approx(5.0)
    assert by["fusion"]["launches_per_layer_step"] == pytest.approx(1.0)
    assert r["busy_us"] == pytest.approx(steps * layers * 10.0)
    assert r["idle_us"] == pytest.approx(steps * layers * 3.0 + (steps - 1) * 4.0)
    # one layer in launch order, bounded by the once-per-layer-step op that takes longest
    assert [x["name"] for x in r["layer"]] == ["fusion", "topk_kernel", "attention_kernel"]
    assert [x["gap_before_us"] for x in r["layer"]] == [0.0, 1.0, 2.0]
    assert r["layer_us"] == pytest.approx(13.0)


def test_overlapping_streams_count_once(prof):
    ev = [dict(ph="X", pid=1, ts=0.0, dur=10.0, name="a"), dict(ph="X", pid=1, ts=5.0, dur=10.0, name="b")]
    r = prof.summarize(ev, steps=1, layers=1)
    assert r["busy_us"] == pytest.approx(15.0) and r["idle_us"] == pytest.approx(0.0)


def _compiled_text():
    import jax
    import jax.numpy as jnp

    def f(x, y):
        z = jnp.where(x > 0, x * 2, y)
        return jnp.sum(z ** 2, axis=0) + jnp.concatenate([x, y])[:4].sum()
    return jax.jit(f).lower(jnp.ones((8, 4)), jnp.ones((8, 4))).compile().as_text()


def test_hlo_sources_name_each_fusion_root_place_and_ops(prof):
    src = prof.hlo_sources(_compiled_text())
    assert src, "no fusion found in the compiled module"
    fused = " ".join(src.values())
    assert "test_profile_decode.py:" in fused and ".f)" in fused      # our file, line and function
    assert "select_n" in fused and "integer_pow" in fused                # the ops fused, by jax name
    for name, s in src.items():
        assert " @ " in s and s.endswith("]"), (name, s)


def test_hlo_sources_fall_back_to_the_fused_instructions_frames(prof):
    """A fusion instruction without a stack frame of its own is placed where its fused instructions are."""
    import re
    text = _compiled_text()
    bare = re.sub(r"(calls=%[\w.\-]+.*?) stack_frame_id=\d+", r"\1", text)   # strip the fusions' own frames
    assert bare != text
    src = prof.hlo_sources(bare)
    assert src and any("test_profile_decode.py:" in s for s in src.values())


def test_attach_sources_maps_kernel_names_and_removes_the_dump(prof, tmp_path):
    text = _compiled_text()
    src = prof.hlo_sources(text)
    name = next(n for n in src if "." not in n) if any("." not in n for n in src) else next(iter(src))
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "module_0007.jit_f.cpu_after_optimizations.txt").write_text(text)
    (dump / "module_0001.jit_other.cpu_after_optimizations.txt").write_text("HloModule jit_other\n")
    kernel = name.replace(".", "_")                                        # fusion.12 is launched as fusion_12
    layer = [dict(name="x", kernel=kernel), dict(name="page_top_k", kernel="page_top_k")]
    events = [dict(args=dict(hlo_module="jit_f"))] * 3 + [dict(args=dict(hlo_module="jit_other"))]
    prof.attach_sources(layer, events, str(dump))
    assert layer[0]["source"] == src[name] and "source" not in layer[1]
    assert not dump.exists()


def test_rule_options_reach_each_row_process(prof, tmp_path, monkeypatch):
    """--key-channels / --label-bits / --hot-share / --two-stage / --token-shortlist go to every row's child process
    (the row is built there); a bad --hot-share, --two-stage or --token-shortlist is refused by name before anything
    runs, and no --two-stage passes none on."""
    import scripts.bench_meta as bm
    seen = []

    def fake_child(cmd, timeout, **row):
        seen.append(cmd)
        return dict(row, error="not run")

    monkeypatch.setattr(bm, "row_in_child", fake_child)
    prof.main(["--out", str(tmp_path), "--rows", "sparse:4096:1", "--key-channels", "64", "--label-bits", "4",
               "--hot-share", "0.9", "--two-stage", "4", "--token-shortlist", "2", "--commit", "abc"])
    cmd = seen[0]
    for flag, value in (("--key-channels", "64"), ("--label-bits", "4"), ("--hot-share", "0.9"), ("--two-stage", "4"),
                        ("--token-shortlist", "2")):
        assert cmd[cmd.index(flag) + 1] == value
    prof.main(["--out", str(tmp_path / "b"), "--rows", "sparse:4096:1", "--commit", "abc"])
    assert "--two-stage" not in seen[1]
    for bad in (["--hot-share", "2"], ["--two-stage", "0"], ["--two-stage", "x"]):
        with pytest.raises(SystemExit):
            prof.build_parser().parse_args(bad)
    for bad in (["--token-shortlist", "-1", "--key-channels", "32"], ["--token-shortlist", "2"]):
        with pytest.raises(SystemExit, match="--token-shortlist"):
            prof.main(["--out", str(tmp_path / "c"), "--rows", "sparse:4096:1", "--commit", "abc"] + bad)
    assert len(seen) == 2
