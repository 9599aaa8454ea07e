"""k3rocm.options: a field declares its flag, default, range, choices and help once; argparse
options come from the fields and a bad value is one UsageError line, however it arrives."""

from __future__ import annotations

import argparse
from typing import Literal

import pytest

from k3rocm.errors import UsageError
from k3rocm.options import Options, like, option


class Toy(Options):
    count: int = option(4, "how many", ge=1, le=8)
    ratio: float = option(0.5, "a share", gt=0, le=1)
    wait: float = option(1.0, "seconds to wait", ge=0, unit=" seconds")
    kind: Literal["a", "b"] = option("a", "which", group="g")
    name: str | None = option(None, "a name", flag="--who", metavar="NAME")
    loud: bool = option(False, "say more")
    fixed: int = 7  # not a flag


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    Toy.add_arguments(p, {})
    return p


def test_flags_come_from_the_fields():
    p = _parser()
    assert Toy.from_args(p.parse_args([])) == Toy()
    got = Toy.from_args(p.parse_args(["--count", "8", "--kind", "b", "--who", "x", "--loud"]))
    assert (got.count, got.kind, got.name, got.loud, got.fixed) == (8, "b", "x", True, 7)
    assert Toy.from_args(p.parse_args(["--count", "2"]), count=3).count == 3  # resolved wins
    with pytest.raises(argparse.ArgumentError):
        p.parse_args(["--kind", "c"])  # the Literal's choices
    with pytest.raises(SystemExit):
        p.parse_args(["--fixed", "1"])
    text = p.format_help()
    assert "how many (default 4)" in text and "--who NAME" in text and "\ng:\n" in text


@pytest.mark.parametrize("values, message", [
    ({"count": 0}, "--count 0 is out of range; use 1..8"),
    ({"ratio": 0}, "--ratio 0 is out of range; use 0 < x <= 1"),
    ({"wait": -1}, "--wait -1 is out of range; use x >= 0 seconds"),
    ({"kind": "c"}, "--kind 'c' is not valid; use a or b"),
    ({"count": "many"}, "--count 'many' is not valid"),
])
def test_a_bad_value_is_one_line_naming_the_flag(values, message):
    with pytest.raises(UsageError) as exc:
        Toy(**values)
    assert str(exc.value).startswith(message) and "\n" not in str(exc.value)


def test_like_reuses_type_default_and_range_under_another_flag():
    class Other(Options):
        n: int = like(Toy, "count", "how many here", flag="--toy-count")

    p = argparse.ArgumentParser()
    Other.add_arguments(p)
    assert Other.from_args(p.parse_args([])).n == 4
    with pytest.raises(UsageError, match=r"^--toy-count 9 is out of range; use 1\.\.8$"):
        Other.from_args(p.parse_args(["--toy-count", "9"]))


def test_skip_leaves_a_flag_to_another_declaration():
    p = argparse.ArgumentParser()
    Toy.add_arguments(p, skip=("count",))
    p.add_argument("--count", default="theirs")  # no conflict: declared once
    assert p.parse_args([]).count == "theirs" and p.parse_args([]).ratio == 0.5
