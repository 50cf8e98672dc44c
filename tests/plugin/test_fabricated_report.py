"""The fabricated run report used by the pytester tests is a valid report (eval's JSON Schema),
so the gates are tested against the same keys the pipeline writes."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema

from .conftest import good_report


def test_good_report_matches_the_report_schema():
    schema = json.loads(resources.files("distillgates").joinpath("schemas/report.schema.json").read_text())
    jsonschema.validate(good_report(), schema)
