"""The thread check in the services the suite starts as subprocesses
(tests/checked_service.py): a statement such a service runs outside the door is refused
there and fails the test that started it, as one in the suite's own process does."""
import pytest

from tests.door import service_refusals
from tests.service_process import ServiceProcess


@pytest.mark.gen_test(timeout=60)
async def test_a_statement_off_the_door_in_a_service_process_fails_the_test_that_started_it(
        tmp_path, database_url, client):
    # A path on the loop that a test plugin adds to the service (tests/off_door_plugin.py).
    service = ServiceProcess(tmp_path / "service.log", DATABASE_URL=database_url,
                             SPOOL_DIR=tmp_path / "spool",
                             DOOR_TEST_PLUGIN="tests.off_door_plugin")
    await service.start()
    try:
        health = await client.fetch(service.url + "/healthz")
        off_door = await client.fetch(service.url + "/test/off-door")
    finally:
        assert await service.terminate() == 0
    # Start-up (migrations, the spool's drain, the scheduler's first jobs) and a page
    # through the door are refused nothing; the plugin's statement is.
    assert health.code == 200
    assert off_door.code == 500
    # What conftest's statements_through_the_door reads after each test (and so fails
    # this one, unless taken here): the statement, the thread, and the line that ran it.
    [refused] = service_refusals()
    assert "SELECT" in refused and "in thread MainThread" in refused
    assert "off_door_plugin.py" in refused
    assert "OutsideTheDoor" in service.log()
