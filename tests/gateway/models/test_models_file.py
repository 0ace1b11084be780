"""The models file (gateway/models/models_file.py): what a valid one gives each model's engine, and
that a bad one is one line naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.models.models_file import ModelEntry, check_memory, served_models
from gateway.settings import Settings, SettingsError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_model_alone_is_a_one_entry_file(demo_model_dir: Path) -> None:
    settings = Settings(model=str(demo_model_dir), max_num_seqs=7)
    (spec,) = served_models(settings)
    assert spec.name == demo_model_dir.resolve().name
    assert spec.entry == ModelEntry(name=spec.name, path=demo_model_dir)
    assert spec.settings is settings
    named = Settings(model=str(demo_model_dir), served_model_name="demo")
    assert served_models(named)[0].name == "demo"


@pytest.mark.smollm2
def test_each_model_gets_the_servers_knobs_and_its_own(
    demo_model_dir: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    path = _write(
        tmp_path,
        f"""
models:
  - name: smollm2
    path: {smollm2_dir}
    engine:
      dtype: float32
      max_num_seqs: 64
  - name: demo
    path: {demo_model_dir}
    idle_timeout: 60
""",
    )
    settings = Settings(models_config=path, max_num_seqs=8, seed=3, port=9000)
    small, demo = served_models(settings)
    assert (small.name, demo.name) == ("smollm2", "demo")
    assert small.settings.model == str(smollm2_dir) and demo.settings.model == str(demo_model_dir)
    assert small.settings.served_model_name == "smollm2"
    # The entry's own knobs; the server's for the rest.
    assert (small.settings.dtype, small.settings.max_num_seqs) == ("float32", 64)
    assert (demo.settings.dtype, demo.settings.max_num_seqs) == ("auto", 8)
    assert small.settings.seed == demo.settings.seed == 3
    assert demo.entry.idle_timeout == 60 and demo.entry.min_replicas == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("models: []", "models: List should have at least 1 item"),
        ("models:\n  - path: {demo}", "models[0].name: Field required"),
        ("models:\n  - {{name: a, path: {demo}, gpus: 2}}", "models[0].gpus: Extra inputs"),
        ("models:\n  - {{name: 'a@b', path: {demo}}}", "models[0].name: String should match"),
        (
            "models:\n  - {{name: a, path: {demo}}}\n  - {{name: a, path: {demo}}}",
            "two models are named 'a'",
        ),
        (
            "models:\n  - {{name: a, path: {demo}, min_replicas: 2, max_replicas: 1}}",
            "models[0]: min_replicas (2) is above max_replicas (1)",
        ),
        (
            "models:\n  - {{name: a, path: {demo}, engine: {{port: 1}}}}",
            "engine: 'port' is not an engine knob",
        ),
        (
            "models:\n  - {{name: a, path: {demo}, engine: {{max_num_seqs: many}}}}",
            "a: engine.max_num_seqs: Input should be a valid integer",
        ),
        (
            "models:\n  - {{name: a, path: {demo}, engine: {{quantization: int4}}}}",
            "a: engine.quantization: Input should be 'int8'",
        ),
        ("models:\n  - {{name: a, path: /nonexistent}}", "models[0].path: /nonexistent is not"),
        ("models: [unclosed", "not YAML"),
        (
            "models:\n  - {{name: a, path: {demo}, urls: [ftp://engine:8100]}}",
            "models[0]: urls: 'ftp://engine:8100' is not an engine's http(s)://host:port",
        ),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(
    demo_model_dir: Path, tmp_path: Path, text: str, says: str
) -> None:
    path = _write(tmp_path, text.format(demo=demo_model_dir))
    with pytest.raises(SettingsError) as refused:
        served_models(Settings(models_config=path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    assert says in message, message


def test_a_missing_file_and_a_served_model_name_beside_it(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(SettingsError, match="No such file"):
        served_models(Settings(models_config=tmp_path / "absent.yaml"))
    path = _write(tmp_path, f"models:\n  - {{name: a, path: {demo_model_dir}}}")
    with pytest.raises(SettingsError, match="--served-model-name"):
        served_models(Settings(models_config=path, served_model_name="b"))


def test_models_that_cannot_fit_together_are_refused_with_the_arithmetic(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    path = _write(
        tmp_path,
        f"""
models:
  - {{name: a, path: {demo_model_dir}, engine: {{kv_cache_memory: 1GiB}}}}
  - {{name: b, path: {demo_model_dir}, engine: {{kv_cache_memory: 512MiB}}}}
""",
    )
    specs = served_models(Settings(models_config=path))  # this machine holds them
    weights = sum(f.stat().st_size for f in demo_model_dir.glob("*.safetensors"))
    need = 2 * weights + (1 << 30) + (512 << 20)
    check_memory(specs, path, available=need)
    with pytest.raises(SettingsError) as refused:
        check_memory(specs, path, available=need - 1)
    message = str(refused.value)
    assert "do not fit in this machine's" in message
    assert "a 1 x (0.02 GiB weights + 1.00 GiB KV) + b 1 x (0.02 GiB weights + 0.50 GiB KV)" in (
        message
    )
    path.write_text(
        f"models:\n  - {{name: a, path: {demo_model_dir}, engine: {{kv_cache_memory: 64TiB}}}}"
    )
    with pytest.raises(SettingsError, match="lower their engine.kv_cache_memory"):
        served_models(Settings(models_config=path))


def test_picker_routing_names_one_inference_gateway(demo_model_dir: Path, tmp_path: Path) -> None:
    """`routing: picker` sends every request to one address: the entry's own routing wins
    over the server's, and the entry must name exactly one url."""
    entry = f"  - name: demo\n    path: {demo_model_dir}\n"
    one = _write(tmp_path, f"models:\n{entry}    urls: [http://gw:80]\n    routing: picker\n")
    (spec,) = served_models(Settings(models_config=one, routing="affinity"))
    assert spec.settings.routing == "picker"
    two = _write(tmp_path, f"models:\n{entry}    urls: [http://a:1, http://b:2]\n")
    with pytest.raises(SettingsError, match="urls names exactly one .it names 2"):
        served_models(Settings(models_config=two, routing="picker"))
    with pytest.raises(SettingsError, match="--routing: .*it names 0"):
        served_models(Settings(model=str(demo_model_dir), routing="picker"))
    bad = _write(tmp_path, f"models:\n{entry}    routing: nearest\n")
    with pytest.raises(SettingsError, match=r"models\[0\]\.routing"):
        served_models(Settings(models_config=bad))
