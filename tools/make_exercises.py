"""Generate exercises/ from solutions/: every `### BEGIN SOLUTION` … `### END SOLUTION`
block in a code cell becomes `raise NotImplementedError(...)`, outputs are dropped.

    python tools/make_exercises.py           # write exercises/
    python tools/make_exercises.py --check   # exit 1 if exercises/ is out of date
"""
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = 'raise NotImplementedError("exercise: write this part")'


def strip_solution(source: str) -> str:
    out, skipping = [], False
    for line in source.split("\n"):
        if line.strip() == BEGIN:
            skipping = True
            out.append(re.match(r"\s*", line).group(0) + STUB)
        elif line.strip() == END:
            if not skipping:
                raise ValueError("### END SOLUTION without BEGIN")
            skipping = False
        elif not skipping:
            out.append(line)
    if skipping:
        raise ValueError("### BEGIN SOLUTION without END")
    return "\n".join(out)


def exercise_notebook(solution: dict) -> dict:
    nb = json.loads(json.dumps(solution))
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            cell["source"] = strip_solution(src)
            cell["outputs"], cell["execution_count"] = [], None
    return nb


def render(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main(check: bool) -> int:
    stale = []
    for sol in sorted((ROOT / "solutions").glob("*.ipynb")):
        target = ROOT / "exercises" / sol.name
        text = render(exercise_notebook(json.loads(sol.read_text())))
        if check:
            if not target.exists() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.parent.mkdir(exist_ok=True)
            target.write_text(text)
    names = {p.name for p in (ROOT / "solutions").glob("*.ipynb")}
    orphans = [p.name for p in (ROOT / "exercises").glob("*.ipynb") if p.name not in names]
    if check and (stale or orphans):
        print("exercises/ is out of date (run `make exercises`):", *stale, *orphans)
        return 1
    for name in orphans if not check else []:
        (ROOT / "exercises" / name).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main("--check" in sys.argv))
