"""Plugins: a package of a user's own registers source kinds and losses without editing cembed.

A plugin is an installed distribution with an entry point in the group ``cembed.plugins``
(:data:`GROUP`)::

    # the plugin's pyproject.toml
    [project.entry-points."cembed.plugins"]
    sql = "sqlkind:register"        # a callable, called once with no arguments
    # or: sql = "sqlkind"           # a module: importing it registers

What it registers, through the registries only: a source kind (its config class with
``cembed.config.sources.register_source_config``, its loader with
``cembed.data.sources.registry.register_source_loader``) and/or a loss (``cembed.losses.registry.register_loss``).
:func:`load_plugins` runs every plugin once per process; the config loader
(:func:`cembed.config.file.config_from_dict`) calls it before validating, so a config may name a
plugin's kind or loss. A plugin is identified by its distribution and its entry-point name: two
distributions may use the same name and both load. A plugin that fails to load (an exception, or
``SystemExit`` and any other ``BaseException`` but ``KeyboardInterrupt``, e.g. ``argparse`` parsing
cembed's command line at import) stops the command with one line naming it and its distribution;
what it prints while loading goes to stderr, never into a command's stdout (``validate --json``).
A registry that refuses a name already taken names the plugin that took it (:func:`plugin_of`), so a
clash of two plugins is one line naming both.

Keep a plugin's module light (import ``datasets``, ``torch`` inside its loader and builder): it is
imported whenever a config is read, ``cembed validate`` included.

May import: ``cembed.errors`` only (the entry points are found with the standard library).
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import ModuleType

from cembed.errors import UserError, first_line

GROUP = "cembed.plugins"

# (distribution, entry point name) -> its value ("module:attr"), for the plugins loaded in this process
LOADED: dict[tuple[str, str], str] = {}
# module name -> the plugin whose loading first imported it (cembed's own modules left out)
MODULES: dict[str, tuple[str, str]] = {}


def describe(plugin: tuple[str, str]) -> str:
    """How messages name a plugin: ``cembed plugin '<entry point>' of distribution '<distribution>'``."""
    distribution, name = plugin
    return f"cembed plugin {name!r} of distribution {distribution!r}"


def plugin_of(obj) -> str | None:
    """:func:`describe` of the loaded plugin that brought ``obj`` (a class or function) in, by the
    module it was defined in (imported first while that plugin loaded); None for cembed's own and
    anything no plugin imported. Registries name it when a name they hold is taken again."""
    plugin = MODULES.get(getattr(obj, "__module__", None) or "")
    return describe(plugin) if plugin else None


def load_plugins() -> dict[tuple[str, str], str]:
    """Load every entry point of the group :data:`GROUP` not loaded yet in this process: import it
    and, unless it is a module, call it with no arguments. What it prints meanwhile goes to stderr.

    Returns:
        The plugins loaded so far: (distribution, entry-point name) -> value (``module:attr``).

    Raises:
        UserError: a plugin that fails to import or to register (any exception, ``SystemExit`` and
            other ``BaseException`` but ``KeyboardInterrupt``), as one line naming the plugin, its
            distribution, its entry point and its error.
    """
    from importlib.metadata import entry_points

    for point in entry_points(group=GROUP):
        key = (point.dist.name if point.dist is not None else "unknown", point.name)
        if key in LOADED:
            continue
        before = set(sys.modules)
        try:
            with stdout_to_stderr():
                target = point.load()
                if not isinstance(target, ModuleType):
                    target()
        except KeyboardInterrupt:
            raise
        except BaseException as err:  # noqa: BLE001 - whatever the plugin raised or exited with, in one line
            raise UserError(
                f"{describe(key)} ({point.value}, entry point group {GROUP}) failed to load: {_reason(err)}"
            ) from None
        finally:
            MODULES.update({m: key for m in set(sys.modules) - before if m.split(".")[0] != "cembed"})
        LOADED[key] = point.value
    return dict(LOADED)


def _reason(err: BaseException) -> str:
    # An exit is no error message of its own: say what the plugin did (argparse at import exits 2).
    if isinstance(err, SystemExit):
        return f"SystemExit({err.code!r}): it tried to end the process while loading (its output, if any, is above)"
    return f"{type(err).__name__}: {first_line(err)}"


@contextlib.contextmanager
def stdout_to_stderr():
    """Send what runs inside to stderr instead of stdout: Python's ``sys.stdout`` and, where the
    process has both descriptors, file descriptor 1 (a C extension's output) too. Plugins load
    under it, and ``validate --json`` runs under it (a plugin's loader that prints), so a command's
    machine-readable stdout holds only what the command writes after it."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:  # no descriptor 1 or 2 (a closed stream): Python's stream only
        saved = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
