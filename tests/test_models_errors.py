"""Bad model files reach Python API users as clear errors (issue 23): a ValueError subclass (CheckpointError,
TokenizerError) or FileNotFoundError naming the file and the key, never a KeyError / TypeError / AttributeError or
a bare Exception from a library. The CLI turns the same errors into one line (tests/test_cli_safety.py)."""
import json
import pathlib
import shutil

import pytest

from ulacache_jax import models
from ulacache_jax.models import CheckpointError, ModelConfig
from ulacache_jax.models.tokenizer import TokenizerError

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "tiny_llama"


def _hf_folder(tmp_path, edit) -> pathlib.Path:
    """A copy of the tiny HF fixture's config.json (no tensors: read_hf_config reads only the config)."""
    d = tmp_path / "hf"
    d.mkdir()
    cfg = json.loads((FIXTURE / "config.json").read_text())
    out = edit(cfg)
    (d / "config.json").write_text(json.dumps(out if isinstance(out, list) else cfg))
    return d


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("num_attention_heads"), "missing required key(s) 'num_attention_heads'"),
    (lambda c: c.update(hidden_size=None), "missing required key(s) 'hidden_size'"),
    (lambda c: c.update(num_attention_heads="8"), "'num_attention_heads' must be a positive int, got '8'"),
    (lambda c: c.update(num_hidden_layers=0), "'num_hidden_layers' must be a positive int, got 0"),
    (lambda c: [c], "a Hugging Face config must be a JSON object, got list"),
    (lambda c: c.update(eos_token_id="</s>"), "special token id '</s>' must be an int"),
    (lambda c: (c.pop("rope_parameters"), c.update(rope_theta="big")), "'rope_theta' must be a number, got 'big'"),
    (lambda c: (c.pop("rope_parameters", None), c.update(rope_scaling="yarn")),
     "'rope_scaling' must be an object or null, got 'yarn'"),
    (lambda c: (c.pop("rope_parameters", None), c.update(rope_scaling={"rope_type": "llama3", "factor": 8.0})),
     "rope scaling 'llama3': missing or bad value (KeyError: 'low_freq_factor')"),
    (lambda c: (c.pop("rope_parameters", None), c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0})),
     "unsupported rope scaling type 'yarn'"),
    (lambda c: c.update(architectures="LlamaForCausalLM"), "'architectures' must be a list of names"),
])
def test_hf_config_errors_name_the_file_and_key(tmp_path, edit, message):
    d = _hf_folder(tmp_path, edit)
    with pytest.raises(CheckpointError) as e:
        models.read_hf_config(d)
    assert message in str(e.value) and str(d / "config.json") in str(e.value)


def test_hf_config_file_problems(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json in model folder"):
        models.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"cannot parse .*config.json"):
        models.read_hf_config(tmp_path)


def test_model_config_from_dict_errors():
    good = models.get_preset("tiny").to_dict()
    with pytest.raises(ValueError, match="must be a mapping"):
        ModelConfig.from_dict("tiny")
    with pytest.raises(ValueError, match=r"missing ModelConfig keys: \['num_heads'\]"):
        ModelConfig.from_dict({k: v for k, v in good.items() if k != "num_heads"})
    with pytest.raises(ValueError, match="rope_scaling must be a mapping"):
        ModelConfig.from_dict({**good, "rope_scaling": "linear"})
    with pytest.raises(ValueError, match="rope_scaling .*unexpected keyword"):
        ModelConfig.from_dict({**good, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "bogus": 1}})
    with pytest.raises(ValueError, match="eos_token_ids must be a list"):
        ModelConfig.from_dict({**good, "eos_token_ids": 3})


def test_tokenizer_errors_name_the_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"cannot read the tokenizer .*tokenizer.json"):
        models.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerError, match="Model missing"):
        models.load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or .gguf"):
        models.load_tokenizer(tmp_path / "nowhere")
    assert issubclass(TokenizerError, ValueError)


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt") / "model"
    models.save(models.from_pretrained(FIXTURE), d)
    return d


def _edited_checkpoint(src, tmp_path, edit) -> pathlib.Path:
    d = tmp_path / "model"
    shutil.copytree(src, d)
    meta = json.loads((d / "model.json").read_text())
    edit(meta)
    (d / "model.json").write_text(json.dumps(meta))
    return d


@pytest.mark.parametrize("edit, error, message", [
    (lambda m: m.pop("config"), CheckpointError, "missing key 'config'"),
    (lambda m: m.pop("dtype"), CheckpointError, "missing key 'dtype'"),
    (lambda m: m.update(dtype="float99"), CheckpointError, "'dtype' 'float99' is not a dtype"),
    (lambda m: m.update(config="tiny"), CheckpointError, "'config': a ModelConfig dict must be a mapping"),
    (lambda m: m["config"].update(bogus=1), CheckpointError, "'config': unknown ModelConfig keys: ['bogus']"),
    (lambda m: m.update(format=7), ValueError, "unsupported checkpoint format 7"),
    (lambda m: m["config"].update(num_layers=m["config"]["num_layers"] + 1), CheckpointError,
     "do not match the config"),
])
def test_orbax_checkpoint_errors_name_the_file_and_key(saved_checkpoint, tmp_path, edit, error, message):
    d = _edited_checkpoint(saved_checkpoint, tmp_path, edit)
    with pytest.raises(error) as e:
        models.load(d)
    assert message in str(e.value) and str(d.absolute()) in str(e.value)


def test_orbax_checkpoint_file_problems(saved_checkpoint, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(saved_checkpoint, d)
    (d / "model.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"cannot parse .*model.json"):
        models.load(d)
    (d / "model.json").write_text("[1]")
    with pytest.raises(CheckpointError, match="must hold a JSON object"):
        models.load(d)
    with pytest.raises(FileNotFoundError, match="no model.json"):
        models.load(tmp_path / "nowhere")
    shutil.rmtree(d)
    shutil.copytree(saved_checkpoint, d)
    shutil.rmtree(d / "params")
    with pytest.raises(FileNotFoundError, match="params"):
        models.load(d)


@pytest.mark.parametrize("fraction", [0.002, 0.01, 0.05, 0.5, 0.9])
def test_gguf_cut_short_is_a_clear_error(tmp_path, fraction):
    """A GGUF cut anywhere (a partial download: inside the header, the metadata or the tensor data) is a
    CheckpointError naming the file and its size, never an IndexError or a reshape error from the reader."""
    src = pathlib.Path(__file__).parent / "fixtures" / "tiny_gguf" / "llama.gguf"
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:max(8, int(len(data) * fraction))])
    with pytest.raises(CheckpointError, match=r"cut\.gguf \(\d+ bytes\).*cut short"):
        models.from_pretrained(str(cut))
