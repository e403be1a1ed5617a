"""Configuration: defaults, TOML, flags, and clear errors for every kind of mistake."""

import pytest

from fastes.cli import main
from fastes.errors import ConfigError
from fastes.run.config import load_config


def test_defaults_are_valid_and_overrides_apply(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'algorithm = "grpo_es"\nseed = 3\n[es]\nsigma = 0.01\npopulation = 8\n[grpo]\nlr = 1e-5\n'
    )
    cfg = load_config(path, {"es.population": 4, "batch_size": 7})
    assert (cfg.algorithm, cfg.seed, cfg.es.sigma, cfg.grpo.lr) == ("grpo_es", 3, 0.01, 1e-5)
    assert cfg.es.population == 4 and cfg.batch_size == 7  # flags override the file


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"populaton": 4}, "unknown config key 'populaton'"),
        ({"es.popsize": 4}, "unknown config key 'es.popsize'"),
        ({"es.population": 1}, "es.population: must be at least 2"),
        ({"es.population": 5}, "even population"),
        ({"es.sigma": 0.0}, "es.sigma: must be a positive finite number"),
        ({"es.lr_scheduler_type": "step"}, "es.lr_scheduler_type: 'step' is not one of"),
        ({"es.warmup_steps": 2.5}, "es.warmup_steps: a count of steps must be whole"),
        ({"grpo.warmup_steps": -1.0}, "grpo.warmup_steps: must be >= 0"),
        ({"es.sigma": "big"}, "es.sigma must be float"),
        ({"es.antithetic": 1}, "es.antithetic must be bool"),
        ({"batch_size": True}, "batch_size must be int"),
        ({"task": "sudoku"}, "task: 'sudoku' does not exist"),
        ({"model": "/nonexistent/model"}, "model '/nonexistent/model' is neither a model directory"),
        ({"algorithm": "ppo"}, "algorithm: 'ppo' is not one of"),
        ({"grpo.loss_type": "ppo"}, "grpo.loss_type"),
        ({"grpo.temperature": 0.0}, "grpo.temperature"),
        ({"dtype": "int8"}, "dtype"),
        ({"es": 3}, "es must be a table"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[es\nsigma = ")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_cli_reports_config_errors_without_a_traceback(capsys):
    assert main(["train", "--es.population", "1"]) == 2
    assert "es.population: must be at least 2" in capsys.readouterr().err


def test_every_key_has_its_help_next_to_it(capsys):
    """A key's help line is its field's metadata (no separate table to keep in step); the CLI shows it."""
    import dataclasses

    import fastes.run.config as config

    assert not hasattr(config, "HELP")
    for section in (config.TrainConfig, config.ESSettings, config.GRPOSettings):
        for f in dataclasses.fields(section):
            if not dataclasses.is_dataclass(f.default_factory):  # [es] and [grpo] are sections
                assert f.metadata.get("help", "").strip(), f"{section.__name__}.{f.name} has no help"
    keys = [key for key, _ in config.flag_specs()]
    assert len(keys) == len(set(keys)) > 60
    assert config.flag_help("es.noise").startswith("distribution of eps: gaussian, or rademacher")
    assert config.flag_help("collective_timeout").endswith("(default: 1800.0)")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--grpo.beta FLOAT weight of the KL (k3) to the starting model" in text


def test_config_and_cli_take_the_noise(capsys):
    assert load_config(None, {}).es.noise == "gaussian"
    assert load_config(None, {"es.noise": "rademacher"}).es.noise == "rademacher"
    with pytest.raises(ConfigError, match="es.noise: 'sign' is not one of"):
        load_config(None, {"es.noise": "sign"})
    assert main(["train", "--es.noise", "sign"]) == 2
    assert "es.noise" in capsys.readouterr().err
