"""PII redaction with ROOTS' tags; dates, versions, paths and decorators stay."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_prep_corpus_text import prose, write_jsonl

from appliance.data.pii import redact
from appliance.data.prep import iter_corpus, prepare_corpus


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Write to jane.doe@example.org today.", "Write to PI:EMAIL today."),
        ("(mail: a.b-c@mail.example.co.uk)", "(mail: PI:EMAIL)"),
        ("Thanks to @octo_cat for the fix", "Thanks to PI:USER for the fix"),
        ("host 192.168.10.42 answered", "host PI:IP_ADDRESS answered"),
        ("listen on 10.0.0.1:8080 now", "listen on PI:IP_ADDRESS:8080 now"),
        ("v6 2001:db8:85a3::8a2e:370:7334 and fe80::1ff:fe23:4567:890a.", "v6 PI:IP_ADDRESS and PI:IP_ADDRESS."),
        ("token ghp_16C7e42F292c6912E7710c838347Ae178B4a leaked", "token PI:KEY leaked"),
        ("sha1 3f786850e387550fdab836ed7e6dc881de23001b ok", "sha1 PI:KEY ok"),
    ],
)
def test_pii_is_redacted_with_roots_tags(text: str, expected: str) -> None:
    assert redact(text)[0] == expected


@pytest.mark.parametrize(
    "text",
    [
        "Released 2021-03-04, patched 12.05.1999 and 04/05/2020, at 12:30:45.",
        "Version 1.2.3 of the tool, section 5.4.5.1. Configuration",
        "See /usr/share/vim/vim90/doc/tags and /sys/class/net/enp0s31f6 for details.",
        "Use --lzma2=preset=6e or x86_64-linux-gnu-gcc-12 and C++ std::vector<int>.",
        "The word internationalization has no digits.",
    ],
)
def test_dates_versions_paths_and_options_are_left_alone(text: str) -> None:
    assert redact(text) == (text, {})


def test_code_keeps_decorators_but_not_emails() -> None:
    code = "@property\ndef owner(self):\n    return 'dev@example.com'\n"
    assert redact(code, code=True)[0] == "@property\ndef owner(self):\n    return 'PI:EMAIL'\n"
    assert redact(code)[0].startswith("PI:USER")


def test_prepared_corpus_is_redacted(tmp_path: Path) -> None:
    text = prose(1) + " Contact admin@corp.example or 172.16.254.1 before 2021-03-04."
    code = "\n".join(["import os", "", "@dataclass", "class Config:", "    email = 'ops@corp.example'"] * 3)
    recs = [{"text": text, "lang": "en"}, {"text": code, "lang": "code"}]
    report = prepare_corpus([write_jsonl(tmp_path / "in.jsonl", recs)], tmp_path / "corpus")
    out = [d["text"] for d in iter_corpus(tmp_path / "corpus")]
    assert out[0].endswith("Contact PI:EMAIL or PI:IP_ADDRESS before 2021-03-04.")
    assert "@dataclass" in out[1] and "ops@corp.example" not in out[1]
    pii = next(s for s in report["stages"] if s["name"] == "pii")
    assert pii["tags"] == {"PI:EMAIL": 4, "PI:IP_ADDRESS": 1}
