"""qvl.vit.engines.cpu_path: whether an engine plugin's routes take vision work on a CPU (measured table, switch)."""

import os

import pytest
import torch

from qvl.vit.engines import cpu_path
from qvl.vit.engines.cpu_path import SWITCH, Measurement, cpu_route_decision, forced_routes

FASTER = Measurement(0.8, "cpu-example-2026-12-03.txt")
SLOWER = Measurement(1.3, "cpu-example-2026-12-03.txt")


@pytest.fixture
def table(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    monkeypatch.setattr(cpu_path, "MEASURED", {("engine", torch.bfloat16): FASTER, ("engine", torch.float32): SLOWER})


def test_measured_table_decides_by_default(table):
    route, why = cpu_route_decision("engine", torch.bfloat16)
    assert route and "0.80x engine's own CPU time in bfloat16" in why and FASTER.source in why
    route, why = cpu_route_decision("engine", torch.float32)
    assert not route and "1.30x" in why and f"{SWITCH}=on routes anyway" in why


def test_unmeasured_steps_aside(table):
    for engine, dtype in (("engine", torch.float16), ("other", torch.bfloat16)):
        route, why = cpu_route_decision(engine, dtype)
        assert not route and "was not measured" in why


@pytest.mark.parametrize(("value", "route"), [("on", True), ("1", True), ("off", False), ("0", False), ("AUTO", None)])
def test_switch_forces_either(table, monkeypatch, value, route):
    monkeypatch.setenv(SWITCH, value)
    expected = {dtype: route for dtype in (torch.bfloat16, torch.float32)}
    if route is None:  # auto: the table
        expected = {torch.bfloat16: True, torch.float32: False}
    for dtype, want in expected.items():
        assert cpu_route_decision("engine", dtype)[0] is want, (value, dtype)


def test_unknown_switch_value_steps_aside(table, monkeypatch):
    monkeypatch.setenv(SWITCH, "sometimes")
    route, why = cpu_route_decision("engine", torch.bfloat16)
    assert not route and "'sometimes' is not one of" in why


def test_forced_routes_restores_the_environment(monkeypatch):
    monkeypatch.setenv(SWITCH, "off")
    with forced_routes(True):
        assert os.environ[SWITCH] == "on"
    assert os.environ[SWITCH] == "off"
    monkeypatch.delenv(SWITCH)
    with forced_routes(False):
        assert os.environ[SWITCH] == "off"
    assert SWITCH not in os.environ
