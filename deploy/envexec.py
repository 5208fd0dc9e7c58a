"""envexec.py FILE COMMAND ARGS...: run COMMAND with FILE's settings added to the
environment, reading FILE as systemd's EnvironmentFile= does (parse_env_file in systemd's
env-file.c), so `rcv` sees exactly the values the service sees. A shell would expand $,
` and \\ in a secret; systemd takes them literally, and so does this."""
import os
import re
import sys

VALID_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# Inside double quotes a backslash escapes only these (and a newline); before any other
# character it is kept, as systemd does.
ESCAPABLE_IN_DOUBLE_QUOTES = '"\\`$'


def parse(text):
    """{name: value} of an EnvironmentFile's text: `#` and `;` lines are comments, a value
    may be '...' (literal), "..." (with \\ escapes) or bare (a \\ escapes the next character,
    trailing blanks are dropped); a \\ at the end of a line continues it."""
    found = {}
    state, key, value, kept = "pre_key", "", "", 0  # kept: value length without trailing blanks
    for char in text + "\n":
        if state == "pre_key":
            if char in "#;":
                state = "comment"
            elif not char.isspace():
                state, key = "key", char
        elif state == "key":
            if char == "\n":
                state = "pre_key"  # a line without "=" means nothing
            elif char == "=":
                state, value, kept = "pre_value", "", 0
            else:
                key += char
        elif state == "pre_value":
            if char == "\n":
                state = "pre_key"
                _store(found, key, value)
            elif char == "'":
                state = "single"
            elif char == '"':
                state = "double"
            elif char == "\\":
                state = "escape"
            elif not char.isspace():
                state, value = "value", value + char
                kept = len(value)
        elif state == "value":
            if char == "\n":
                state = "pre_key"
                _store(found, key, value[:kept])
            elif char == "\\":
                state = "escape"
            else:
                value += char
                if not char.isspace():
                    kept = len(value)
        elif state == "escape":
            state = "value"
            if char != "\n":  # backslash-newline continues the line
                value += char
                kept = len(value)
        elif state == "single":
            if char == "'":
                state, kept = "pre_value", len(value)
            else:
                value += char
        elif state == "double":
            if char == '"':
                state, kept = "pre_value", len(value)
            elif char == "\\":
                state = "double_escape"
            else:
                value += char
        elif state == "double_escape":
            state = "double"
            if char in ESCAPABLE_IN_DOUBLE_QUOTES:
                value += char
            elif char != "\n":
                value += "\\" + char
        elif state == "comment":
            if char == "\\":
                state = "comment_escape"
            elif char == "\n":
                state = "pre_key"
        elif state == "comment_escape":
            state = "comment"
    return found


def _store(found, key, value):
    key = key.strip()
    if VALID_NAME.match(key):  # systemd ignores (and warns about) an invalid name
        found[key] = value
    else:
        print(f"envexec: ignoring invalid name {key!r}", file=sys.stderr)


def main(argv):
    if len(argv) < 3:
        print("usage: envexec.py FILE COMMAND [ARGS...]", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as env_file:
        settings = parse(env_file.read())
    os.execvpe(argv[2], argv[2:], {**os.environ, **settings})


if __name__ == "__main__":
    sys.exit(main(sys.argv))
