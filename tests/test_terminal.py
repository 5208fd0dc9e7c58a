"""`receiver.py console hash-password` typed at a terminal: the prompt says what it
takes, and giving up (Ctrl-D, Ctrl-C) is one line and exit 1, not a traceback."""
import pytest

from ops.passwords import verify_password
from tests.terminal import OnATerminal

PASSWORD = "correct horse battery"


@pytest.mark.gen_test(timeout=90)
async def test_the_prompt_says_the_minimum_and_two_typed_passwords_make_a_hash():
    async with OnATerminal("console", "hash-password") as terminal:
        await terminal.wait_for("Console password (12 characters or more): ")
        terminal.type(PASSWORD.encode() + b"\n")
        await terminal.wait_for("Again: ")
        terminal.type(PASSWORD.encode() + b"\n")
        await terminal.finish()
    assert terminal.returncode == 0, terminal.shown
    assert verify_password(PASSWORD, terminal.stdout.strip())
    assert PASSWORD not in terminal.shown  # typed without echo


@pytest.mark.parametrize("key,at", [(b"\x04", "first"), (b"\x03", "first"),
                                    (b"\x04", "again"), (b"\x03", "again")],
                         ids=["ctrl-d", "ctrl-c", "ctrl-d-again", "ctrl-c-again"])
@pytest.mark.gen_test(timeout=90)
async def test_ctrl_d_or_ctrl_c_gives_up_in_one_line(key, at):
    async with OnATerminal("console", "hash-password") as terminal:
        await terminal.wait_for("characters or more): ")
        if at == "again":
            terminal.type(PASSWORD.encode() + b"\n")
            await terminal.wait_for("Again: ")
        terminal.type(key)
        await terminal.finish()
    assert (terminal.returncode, terminal.stdout) == (1, "")
    assert "Traceback" not in terminal.shown
    assert terminal.shown.rstrip().endswith("receiver: no password given; nothing printed")
