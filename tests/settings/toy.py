"""A small group with a nested one, to try the settings mechanism on (tests/settings/test_setting.py, test_build.py,
test_cli.py)."""

from __future__ import annotations

from dataclasses import dataclass

from settings.setting import check, group, setting


@dataclass(frozen=True, slots=True)
class Inner:
    """A nested group."""

    depth: int = setting(2, low=0, readers="worker", help="how deep")


@dataclass(frozen=True, slots=True)
class Toy:
    """A group to try the declarations on."""

    size: int = setting(4, low=1, high=64, readers="scheduler", help="how many")
    share: float | None = setting(None, low=0, below=1, readers="scheduler", help="how much")
    mode: str = setting("a", choices=("a", "b"), readers="scheduler", help="which")
    names: tuple[str, ...] = setting((), name="name", repeat="append", readers="scheduler", help="what")
    on: bool = setting(True, readers="scheduler", help="whether")
    inner: Inner = group(Inner)

    def __post_init__(self) -> None:
        check(self)
