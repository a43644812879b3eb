"""The README's minimal loop and elastic command, as the README has them."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_minimal_loop():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("## A minimal loop"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_elastic_command():
    """The elastic ``horovodrun`` line that follows "or elastically:" in the README."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    section = text[text.index("or elastically:"):]
    return re.search(r"```bash\n(horovodrun [^\n]*)\n```", section).group(1)
