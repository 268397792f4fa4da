"""The MPI Operator's v2beta1 CRD schema (vendored in tests/fixtures/, trimmed to the fields hvdtrain writes) as
the API server checks a manifest with strict field validation: the fixture of every rendered-MPIJob test."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

CRD_SCHEMA = Path(__file__).resolve().parents[1] / "fixtures" / "mpijob-v2beta1-openapi.yaml"
INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def strict_json_schema(node: object) -> object:
    """OpenAPI (structural, k8s) -> JSON Schema as the API server checks it with strict field validation:
    unknown fields are errors, intNN formats are ranges, x-kubernetes-* and defaults are dropped."""
    if isinstance(node, list):
        return [strict_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "default"}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if out.get("type") == "integer" and out.get("format") in INT_RANGES:
        out["minimum"], out["maximum"] = INT_RANGES[out.pop("format")]
    return out


@pytest.fixture(scope="package")
def validator() -> jsonschema.Draft7Validator:
    schema = strict_json_schema(yaml.safe_load(CRD_SCHEMA.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


