"""Rollout files: JSONL or Parquet records of prompt/response token ids with rewards.

Two record shapes are accepted (one shape per file):

* one record per response (what most RL frameworks dump)::

      {"uid": "q17", "prompt_ids": [..], "response_ids": [..], "reward": 1.0,
       "old_logprobs": [..], "ref_logprobs": [..], "advantage": 0.7}          # last three optional

  Records sharing a ``uid`` form a group and must carry identical ``prompt_ids``. Without ``uid``
  (in every record), records with identical ``prompt_ids`` form a group.

* one record per group::

      {"uid": "q17", "prompt_ids": [..], "responses": [[..], [..]], "rewards": [1.0, 0.0],
       "old_logprobs": [[..], [..]], "ref_logprobs": [[..], [..]], "advantages": [..]}   # optional

Groups keep the order of their first record. Every problem is reported with the file, the record
(line for JSONL, row for Parquet) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from .rollout import RolloutBatch, RolloutGroup, finite_float

__all__ = ["load_rollout_file", "save_rollout_file"]

_RESPONSE_REQUIRED = ("prompt_ids", "response_ids", "reward")
_GROUP_REQUIRED = ("prompt_ids", "responses", "rewards")
_OPTIONAL_LOGPROBS = ("old_logprobs", "ref_logprobs")


def _fail(msg: str) -> None:
    raise ValueError(msg)


def _records(path: Path) -> Iterator[tuple[str, object]]:
    """(where, record) for every record of a JSONL or Parquet file."""
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as e:
                    _fail(f"{path}:{n}: not valid JSON ({e.msg}); expected one JSON object per line")
    elif suffix in (".parquet", ".pq"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:  # pragma: no cover - depends on the install
            raise ImportError(f"{path}: reading Parquet rollouts needs pyarrow (pip install pyarrow)") from e
        for n, rec in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path} row {n}", rec
    else:
        _fail(f"{path}: expected a .jsonl or .parquet rollout file, got suffix {suffix!r}")


def _token_ids(value, name: str) -> torch.Tensor:
    if not isinstance(value, (list, tuple)):
        _fail(f"{name}: expected a list of token ids, got {type(value).__name__}")
    if len(value) == 0:
        _fail(f"{name}: expected at least 1 token, got an empty list")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            _fail(f"{name}: expected non-negative integer token ids, got {v!r}")
    return torch.tensor(value, dtype=torch.long)


def _floats(value, name: str, n: int | None = None) -> torch.Tensor:
    if not isinstance(value, (list, tuple)):
        _fail(f"{name}: expected a list of numbers, got {type(value).__name__}")
    if n is not None and len(value) != n:
        _fail(f"{name}: expected {n} values, got {len(value)}")
    return torch.tensor([finite_float(v, name) for v in value], dtype=torch.float32)


def _require(rec: dict, fields: tuple[str, ...], where: str, shape: str) -> None:
    missing = [f for f in fields if rec.get(f) is None]
    if missing:
        _fail(f"{where}: missing field {missing[0]!r}; a {shape} record needs {list(fields)}")


def _group_record(rec: dict, where: str, index: int) -> RolloutGroup:
    _require(rec, _GROUP_REQUIRED, where, "per-group")
    prompt = _token_ids(rec["prompt_ids"], f"{where} prompt_ids")
    if not isinstance(rec["responses"], (list, tuple)) or len(rec["responses"]) == 0:
        _fail(f"{where} responses: expected a non-empty list of responses, got {rec['responses']!r}")
    responses = [_token_ids(r, f"{where} responses[{i}]") for i, r in enumerate(rec["responses"])]
    n = len(responses)
    extra = {}
    for name in _OPTIONAL_LOGPROBS:
        if rec.get(name) is not None:
            vals = rec[name]
            if not isinstance(vals, (list, tuple)) or len(vals) != n:
                _fail(f"{where} {name}: expected {n} lists (one per response), got {type(vals).__name__}")
            extra[name] = [_floats(v, f"{where} {name}[{i}]", len(r)) for i, (v, r) in enumerate(zip(vals, responses))]
    if rec.get("advantages") is not None:
        extra["advantages"] = _floats(rec["advantages"], f"{where} advantages", n)
    rewards = _floats(rec["rewards"], f"{where} rewards", n)
    return RolloutGroup(prompt, responses, rewards, uid=rec.get("uid", index), **extra)


class _Pending:
    """Responses of one group collected from per-response records."""

    def __init__(self, uid, prompt: torch.Tensor, where: str):
        self.uid, self.prompt, self.where = uid, prompt, where
        self.responses, self.rewards, self.adv = [], [], []
        self.logprobs = {name: [] for name in _OPTIONAL_LOGPROBS}

    def add(self, rec: dict, where: str, prompt: torch.Tensor) -> None:
        if prompt.shape != self.prompt.shape or not torch.equal(prompt, self.prompt):
            _fail(f"{where}: prompt_ids differ from those of {self.where} although both have uid {self.uid!r}; "
                  "expected every response of a group to share one prompt")
        resp = _token_ids(rec["response_ids"], f"{where} response_ids")
        self.responses.append(resp)
        self.rewards.append(finite_float(rec["reward"], f"{where} reward"))
        if rec.get("advantage") is not None:
            self.adv.append(finite_float(rec["advantage"], f"{where} advantage"))
        for name in _OPTIONAL_LOGPROBS:
            if rec.get(name) is not None:
                self.logprobs[name].append(_floats(rec[name], f"{where} {name}", resp.numel()))

    def build(self) -> RolloutGroup:
        n = len(self.responses)
        extra = {}
        for name, vals in self.logprobs.items():
            if vals:
                if len(vals) != n:
                    _fail(f"{self.where} (uid {self.uid!r}) {name}: given for {len(vals)} of the group's {n} responses; "
                          "expected all or none")
                extra[name] = vals
        if self.adv:
            if len(self.adv) != n:
                _fail(f"{self.where} (uid {self.uid!r}) advantage: given for {len(self.adv)} of the group's {n} "
                      "responses; expected all or none")
            extra["advantages"] = torch.tensor(self.adv)
        return RolloutGroup(self.prompt, self.responses, torch.tensor(self.rewards), uid=self.uid, **extra)


def load_rollout_file(path: str | Path) -> RolloutBatch:
    """Every group of a JSONL / Parquet rollout file, validated (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        _fail(f"rollout file: {path} does not exist or is not a file")
    groups: list[RolloutGroup] = []
    pending: dict = {}
    shape, with_uid = None, None
    for where, rec in _records(path):
        if not isinstance(rec, dict):
            _fail(f"{where}: expected a JSON object / table row, got {type(rec).__name__}")
        rec_shape = "group" if "responses" in rec else "response" if "response_ids" in rec else None
        if rec_shape is None:
            _fail(f"{where}: missing field 'response_ids' (one record per response) or 'responses' (one per group)")
        if shape is not None and rec_shape != shape:
            _fail(f"{where}: a per-{rec_shape} record in a file of per-{shape} records; expected one shape per file")
        shape = rec_shape
        if shape == "group":
            groups.append(_group_record(rec, where, len(groups)))
            continue
        _require(rec, _RESPONSE_REQUIRED, where, "per-response")
        has_uid = rec.get("uid") is not None
        if with_uid is not None and has_uid != with_uid:
            _fail(f"{where}: field 'uid' is {'present' if has_uid else 'missing'} here but not in earlier records; "
                  "expected it in every record or in none")
        with_uid = has_uid
        prompt = _token_ids(rec["prompt_ids"], f"{where} prompt_ids")
        key = rec["uid"] if has_uid else tuple(prompt.tolist())
        if isinstance(key, list):
            _fail(f"{where} uid: expected a string or number, got a list")
        if key not in pending:
            pending[key] = _Pending(key if has_uid else len(pending), prompt, where)
        pending[key].add(rec, where, prompt)
    if shape is None:
        _fail(f"{path}: no records; expected at least one rollout")
    if shape == "response":
        groups = [p.build() for p in pending.values()]
    return RolloutBatch(groups, meta={"source": str(path)})


def _group_to_records(g: RolloutGroup, per_response: bool) -> list[dict]:
    uid = g.uid if isinstance(g.uid, (str, int)) else str(g.uid)
    lp = {name: getattr(g, name) for name in _OPTIONAL_LOGPROBS if getattr(g, name) is not None}
    if not per_response:
        rec = {"uid": uid, "prompt_ids": g.prompt_ids.tolist(), "responses": [r.tolist() for r in g.response_ids],
               "rewards": g.rewards.tolist()}
        rec.update({name: [v.tolist() for v in vals] for name, vals in lp.items()})
        if g.advantages is not None:
            rec["advantages"] = g.advantages.tolist()
        return [rec]
    out = []
    for i, r in enumerate(g.response_ids):
        rec = {"uid": uid, "prompt_ids": g.prompt_ids.tolist(), "response_ids": r.tolist(), "reward": float(g.rewards[i])}
        rec.update({name: vals[i].tolist() for name, vals in lp.items()})
        if g.advantages is not None:
            rec["advantage"] = float(g.advantages[i])
        out.append(rec)
    return out


def save_rollout_file(batch: RolloutBatch, path: str | Path, *, per_response: bool = True) -> Path:
    """Write ``batch`` as JSONL or Parquet (by suffix), one record per response or per group."""
    path = Path(path)
    records = [rec for g in batch.groups for rec in _group_to_records(g, per_response)]
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    elif path.suffix.lower() in (".jsonl", ".json"):
        with path.open("w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    else:
        _fail(f"path: expected a .jsonl or .parquet file name, got {path.name!r}")
    return path
