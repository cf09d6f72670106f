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
plugin's kind or loss. A plugin that fails to load stops the command with one line naming it.

Keep a plugin's module light (import ``datasets``, ``torch`` inside its loader and builder): it is
imported whenever a config is read, ``cembed validate`` included.

May import: ``cembed.errors`` only (the entry points are found with the standard library).
"""

from __future__ import annotations

from types import ModuleType

from cembed.errors import UserError, first_line

GROUP = "cembed.plugins"

# entry point name -> its value ("module:attr"), for the plugins loaded in this process
LOADED: dict[str, str] = {}


def load_plugins() -> dict[str, str]:
    """Load every entry point of the group :data:`GROUP` not loaded yet in this process: import it
    and, unless it is a module, call it with no arguments.

    Returns:
        The plugins loaded so far: entry-point name -> value (``module:attr``).

    Raises:
        UserError: a plugin that fails to import or to register, as one line naming the plugin,
            its entry point and its error.
    """
    from importlib.metadata import entry_points

    for point in entry_points(group=GROUP):
        if point.name in LOADED:
            continue
        try:
            target = point.load()
            if not isinstance(target, ModuleType):
                target()
        except Exception as err:  # noqa: BLE001 - whatever the plugin raised, named in one line
            raise UserError(
                f"cembed plugin {point.name!r} ({point.value}, entry point group {GROUP}) failed to load: "
                f"{type(err).__name__}: {first_line(err)}"
            ) from None
        LOADED[point.name] = point.value
    return dict(LOADED)
