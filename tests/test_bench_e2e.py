"""scripts/bench_e2e.py on CPU: one row of the real generate path (tiny random preset) and its fields."""
import importlib.util
import json
import pathlib

import pytest


@pytest.mark.slow
def test_one_row_times_the_real_generate_path(capsys):
    path = pathlib.Path(__file__).parent.parent / "scripts" / "bench_e2e.py"
    spec = importlib.util.spec_from_file_location("bench_e2e", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--one", "--rows", "tiny:70", "--attention", "sparse", "--page", "16"])
    row = json.loads([x for x in capsys.readouterr().out.splitlines() if x.startswith("ROW ")][-1][4:])
    assert row["attention"] == "sparse" and row["prompt_tokens"] == 70
    assert row["new_tokens"] == 1 + 2 * 16                         # the decode call's tokens all came back
    assert row["first_token_s"] > 0 and row["prefill_s"] > 0 and row["decode_tok_s"] > 0
