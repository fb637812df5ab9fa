"""JSON Schema documents for consumers written in other languages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from schemas.envelope import Envelope
from schemas.topics import MESSAGES


def json_schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema: the envelope, then one per message version."""
    documents = {"envelope.schema.json": Envelope.model_json_schema(by_alias=True)}
    for ref, message in MESSAGES.items():
        name, version = ref.split("/")
        schema = message.model_json_schema()
        schema["$id"] = ref
        documents[f"{name}.v{version}.schema.json"] = schema
    return documents


def export_json_schemas(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, schema in json_schemas().items():
        path = directory / filename
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
