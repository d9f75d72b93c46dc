"""scripts/bench_labels.py at its --tiny shapes (CPU interpret mode): every variant (the reference, the kernel's
launch shapes, the spanning launch, the tensor-core kernel at 4 bits) is checked against the reference on random and
adversarial inputs and timed, and the JSON and PNG are written under --out."""
import json

import pytest

from scripts import bench_labels


@pytest.mark.parametrize("bits", [4, pytest.param(8, marks=pytest.mark.slow)])   # 4: the default
def test_tiny_run_checks_every_variant_and_writes(tmp_path, bits):
    bench_labels.main(["--tiny", "--bits", str(bits), "--out", str(tmp_path), "--commit", "test"])
    name = "labels" if bits == 4 else "labels_8bit"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    rows = data["rows"]
    assert {r["impl"] for r in rows} == ({"ref", "kernel", "span", "mma"} if bits == 4 else {"ref", "kernel", "span"})
    assert any(r.get("pages_per_program") == data["shapes"]["P"] for r in rows)     # one program a (s, j)
    for r in rows:
        assert r["ok"] and "error" not in r, r
        assert r["us"] > 0 and r["bytes"] == data["bytes_per_call"] and 0 < r["fraction_of_read"]
    assert data["meta"]["commit"] == "test" and data["shapes"]["bits"] == bits
    assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_variants_leave_out_launch_shapes_the_pages_cannot_split():
    a = bench_labels.build_parser().parse_args(["--pages", "48", "--blocks", "3", "4", "32", "--warps", "4",
                                                "--spans", "16", "32", "48", "--span-block", "4",
                                                "--mma-spans", "8", "32", "--mma-stages", "3"])
    got = [(v["impl"], v.get("block_pages"), v.get("pages_per_program")) for v in bench_labels.variants(a)]
    assert got == [("ref", None, None), ("kernel", 4, None), ("span", 4, 16), ("span", 4, 48), ("mma", None, 8)]


def test_a_variant_that_misses_the_reference_is_recorded_and_not_timed(tmp_path, monkeypatch):
    real = bench_labels.score_fn

    def off_by_one_span(v, a, layer):
        f = real(v, a, layer)
        return (lambda c, s, q: f(c, s, q) + 1.0) if v["impl"] == "span" else f

    monkeypatch.setattr(bench_labels, "score_fn", off_by_one_span)
    bench_labels.main(["--tiny", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "labels.json").read_text())["rows"]
    for r in rows:
        assert r["ok"] == (r["impl"] != "span") and ("us" in r) == r["ok"], r
    assert all(r["max_abs_err"] >= 1.0 - 1e-5 for r in rows if r["impl"] == "span")
