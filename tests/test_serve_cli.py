"""`ulacache serve`'s command line: options shared with `generate` (one function adds them to both), option
errors before anything loads, and the message naming the extra to install when the serving packages are missing."""
import contextlib
import importlib.util
import io

from ulacache_jax.app import cli


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _dests(parser_args):
    return set(vars(cli.build_parser().parse_args(parser_args)))


def test_serve_shares_the_engine_options_of_generate():
    gen = _dests(["generate", "--input", "i", "--output", "o"])
    serve = _dests(["serve"])
    shared = {"model", "seed", "token_budget", "page_size", "hbm_pages", "host_gb", "max_seqs", "max_context",
              "max_prefill_tokens", "key_channels", "label_bits", "channel_table", "no_prefix_cache", "attention",
              "tp", "speculative", "num_speculative_tokens", "draft_model", "dtype", "compile_cache",
              "token_shortlist", "two_stage"}
    assert shared <= gen & serve
    assert {"host", "port", "max_queue", "served_model_name", "warmup"} <= serve - gen
    a = cli.build_parser().parse_args(["serve"])
    assert (a.host, a.port) == ("127.0.0.1", 8000)      # loopback unless asked
    # a stream gets its tokens every 8 decode steps; whole pages with speculative decoding and for generate
    assert cli.decode_chunk_steps(a) == 8
    assert cli.decode_chunk_steps(cli.build_parser().parse_args(["serve", "--speculative", "ngram"])) is None
    assert cli.decode_chunk_steps(cli.build_parser().parse_args(["serve", "--decode-chunk-steps", "16"])) == 16
    assert cli.decode_chunk_steps(cli.build_parser().parse_args(["generate", "--input", "i", "--output", "o"])) is None


def test_serve_option_errors_exit_2_before_loading():
    for argv, text in ((["--port", "70000"], "--port 70000"), (["--max-queue", "-1"], "--max-queue"),
                       (["--token-budget", "100", "--page-size", "64"], "multiple of --page-size"),
                       (["--attention", "dense", "--hbm-pages", "8"], "--hbm-pages"),
                       (["--speculative", "draft"], "--draft-model"),
                       (["--decode-chunk-steps", "3"], "--decode-chunk-steps 3 must be a power of two"),
                       (["--decode-chunk-steps", "128", "--page-size", "64"], "<= --page-size 64"),
                       (["--decode-chunk-steps", "8", "--speculative", "ngram"], "with --speculative")):
        rc, _, err = run_cli(["serve", "--model", "tiny", *argv])
        assert rc == 2 and text in err, (argv, err)


def test_serve_without_its_packages_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    rc, _, err = run_cli(["serve", "--model", "tiny"])
    assert rc == 2 and "uvicorn" in err and "ulacache-jax[serve]" in err
