"""The plain-text mails as they render: the templates' environment takes the newline after
a block tag away (trim_blocks), so a line of text that ends with one runs into the next
unless a blank line follows it (the "not handled" mail printed "(Frappe's time)Now in:")."""
import glob
import os
import re

from app.context import TEMPLATES_DIR, template_environment

BLOCK_TAG = re.compile(r"\{%.*?%\}")


def test_the_environment_takes_the_newline_after_a_block_tag():
    rendered = template_environment().from_string("a{% if x %}\nb{% endif %}\nc").render(x=1)
    assert rendered == "abc"


def test_no_line_of_a_plain_text_mail_runs_into_the_next():
    joined = []
    for path in sorted(glob.glob(os.path.join(TEMPLATES_DIR, "**", "*.txt"), recursive=True)):
        with open(path, encoding="utf-8") as template:
            lines = template.read().splitlines()
        for number, (line, following) in enumerate(zip(lines, lines[1:] + [""]), 1):
            text_before = BLOCK_TAG.sub("", line).strip()
            if (text_before and line.rstrip().endswith("%}")
                    and not line.rstrip().endswith("+%}") and following.strip()):
                joined.append(f"{os.path.relpath(path, TEMPLATES_DIR)}:{number}: {line}")
    assert joined == []
