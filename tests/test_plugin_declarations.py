"""What each plugin declares beside itself (plugins.registry.Placement: what makes two
deliveries one fact, which stream it waits in, its place there, as its sender's record
says), and that each registered type is a row of docs/BEHAVIOUR.md and an entry of
docs/INTEGRATIONS.md: the steps docs/ARCHITECTURE.md names for adding an event type."""
import os
import re

import pytest

import plugins
from plugins.registry import Placement, Registry
from tests.ops_helpers import ROOT


def doc(name):
    with open(os.path.join(ROOT, "docs", name), encoding="utf-8") as text:
        return text.read()


def section(text, heading):
    """The text under `heading` (a whole heading line), up to the next heading of its
    level or above."""
    match = re.search(rf"^{re.escape(heading)}$", text, re.MULTILINE)
    assert match, heading
    level = len(heading.split(" ", 1)[0])
    after = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, match.end())
    return text[match.end():after.start() if after else len(text)]


def table_keys(text):
    """The first cells of a markdown table's rows, each split at commas."""
    return {key.strip().strip("`") for row in re.findall(r"^\| ([^|]+) \|", text, re.MULTILINE)
            for key in row.split(",")}


def test_a_plugin_without_its_placement_is_refused():
    registry = Registry("probe")
    with pytest.raises(TypeError, match="declares its Placement"):
        registry.register("probe.event", None)
    with pytest.raises(TypeError):
        registry.register("probe.event", {"same": lambda payload: None})

    def nothing(payload):
        return None
    registry.register("probe.event", Placement(nothing, nothing, nothing))(lambda *_: None)
    with pytest.raises(ValueError, match="two plugins"):
        registry.register("probe.event", Placement(nothing, nothing, nothing))(
            lambda *_: None)


@pytest.mark.parametrize("source", ["workflow", "card", "crypto"])
def test_every_registered_type_declares_its_placement(source):
    registry = plugins.registries()[source]
    assert len(registry) > 0
    for key in registry.keys():
        assert isinstance(registry.placement(key), Placement), key


def test_a_payload_its_placement_cannot_read_is_placed_by_arrival_alone(caplog):
    registry = plugins.registries()["workflow"]
    placed = registry.placed("formation/submitted", ["not", "an", "object"])
    assert (placed.same, placed.stream, placed.version) == (None, None, None)
    assert "not placed by its sender's record" in caplog.text


def test_every_workflow_path_is_a_row_of_behaviour_md_and_in_the_integrations_guide():
    registry = plugins.registries()["workflow"]
    behaviour = doc("BEHAVIOUR.md")
    rows = table_keys(section(behaviour, "### 4.1 Workflow webhooks"))
    states = section(behaviour, "### 3.3 Payment and fulfilment")
    frappe = section(doc("INTEGRATIONS.md"), "## 1. Workflow system (Frappe)")
    worker = section(doc("INTEGRATIONS.md"), "## 4. Worker")
    for path in registry.keys():
        if path.startswith("fulfillment/"):
            status = path.split("/", 1)[1]
            assert f"`{status}`" in states, path
            assert f"`{status}`" in worker, path
        else:
            assert path in rows, path
            assert f"`{path}`" in frappe or f"| {path} |" in frappe, path


def test_every_card_event_type_is_a_row_of_behaviour_md_and_on_the_stripe_listen_line():
    registry = plugins.registries()["card"]
    rows = table_keys(section(doc("BEHAVIOUR.md"), "### 4.2 Card-processor webhook"))
    [line] = re.findall(r"--events (\S+)", doc("INTEGRATIONS.md"))
    listened = line.split(",")
    assert sorted(listened) == registry.keys()
    assert set(registry.keys()) <= rows, set(registry.keys()) - rows


def test_every_crypto_status_is_in_behaviour_md_and_in_the_integrations_guide():
    registry = plugins.registries()["crypto"]
    behaviour = section(doc("BEHAVIOUR.md"), "### 4.3 Crypto-processor webhook")
    guide = section(doc("INTEGRATIONS.md"), "## 3. Crypto processor (SHKeeper)")
    for status in registry.keys():
        assert f"`{status}`" in behaviour, status
        assert f"`{status}`" in guide, status
