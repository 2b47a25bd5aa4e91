"""Results as JSONL, one line per (dataset, problem, method, batch, temperature, sample): a rerun
with the same file skips the lines already there, so an interrupted bench resumes."""

import json
from pathlib import Path

KEY_FIELDS = ("dataset", "problem", "method", "batch", "temperature", "sample")


def key_of(record: dict) -> tuple:
    return tuple(record[f] for f in KEY_FIELDS)


class ResultStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[tuple, dict] = {}
        if self.path.exists():
            for n, line in enumerate(self.path.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interrupted write: redone
                    print(f"[bench] {self.path}:{n}: unreadable line skipped (it will be rerun)")
                    continue
                self.records[key_of(record)] = record

    def done(self, key: tuple) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.records[key_of(record)] = record

    def all(self) -> list[dict]:
        return list(self.records.values())
