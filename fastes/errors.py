"""Errors a user can fix: a bad setting, file or directory.

The `fastes` command prints any FastesError as one line, `fastes: <message>`, and exits with status 2;
the message names the key or file and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable


class FastesError(Exception):
    """Bad input that the user can fix; the message names the key or file and the fix."""


class ConfigError(FastesError, ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range: raised by the run's
    config (fastes.run.config), the trainers' configs and every other check of a setting, on any floor."""


class OptionError(ConfigError):
    """One argument of fastes.ES out of range: "<option>: <problem>". The run config and the trainers
    re-raise it under their own name for the option (es.population, population_size)."""

    def __init__(self, option: str, problem: str) -> None:
        self.option = option
        self.problem = problem
        super().__init__(f"{option}: {problem}")


class MissingFileError(FastesError, FileNotFoundError):
    """A file or directory that the user named does not exist."""


class MissingPackageError(FastesError, ImportError):
    """An optional package that a chosen setting needs is not installed."""


class NonFiniteUpdateError(FastesError, ValueError):
    """A perturbation or an update that would make weights NaN or inf, refused before it was applied (or
    undone): the weights are as they were. The message names the settings to change; each face (fastes.ES,
    the run config, the trainer) has its own names for them, so `template` refers to them as {lr},
    {sigma}, ... and `renamed` gives the same error in another face's names."""

    def __init__(self, template: str, names: dict[str, str] | None = None) -> None:
        self.template = template
        self.names = dict(names or {})
        super().__init__(template.format_map(self.names))

    def renamed(self, name: Callable[[str], str]) -> NonFiniteUpdateError:
        """The same error with each setting's current name n shown as name(n)."""
        return NonFiniteUpdateError(self.template, {k: name(v) for k, v in self.names.items()})
