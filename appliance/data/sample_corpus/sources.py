"""Which Debian packages the sample corpus is cut from, pinned to the versions the shipped files were built from.

One row per package. `rebuild.py` downloads exactly these versions (Debian 12 "bookworm"), so a rerun on a
machine with the same mirror writes byte-identical files. Licenses are read from each package's
/usr/share/doc/<package>/copyright and written as SPDX ids where one exists.

Budgets are bytes of UTF-8 text per source. A language gets roughly 0.7-0.9 MB in all, so no language
dominates the mix; CJK text spends 3 bytes per character, which still leaves ~250k characters per language.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["man", "html", "fortune", "code"]

# manpages-l10n ships every translation under GPL-3+ (debian/copyright: all po/<lang>/ files are GPL-3+).
L10N_LICENSE = "GPL-3.0-or-later"
L10N_HOLDERS = "the manpages-l10n translators (2010-2023 Tobias Quathamer, Helge Kreutzmann et al.)"
L10N_WHAT = (
    "translated manual pages ({where}), formatted to plain text with groff, without the translator-credits "
    "section; one page per document"
)
# manpages-l10n appends the same translator-credits section to every page; repeated ~100 times it would
# teach a small model one paragraph by heart, so it is left out (NOTICE credits the translators instead).
L10N_CREDITS_HEADING = {
    "de": "ÜBERSETZUNG",
    "es": "TRADUCCIÓN",
    "fr": "TRADUCTION",
    "it": "TRADUZIONE",
    "pl": "TŁUMACZENIE",
    "pt": "TRADUÇÃO",
    "ru": "ПЕРЕВОД",
}


@dataclass(frozen=True)
class Source:
    package: str  # Debian binary package
    version: str  # exact Debian version (epoch included) passed to `apt-get download package=version`
    lang: str  # ISO 639-1 code, or "code" for source code
    kind: Kind
    include: tuple[str, ...]  # glob patterns relative to the extracted package root
    license: str  # SPDX id (or short name) for every record; "from-page" reads each man page's SPDX line
    holders: str  # copyright holders as debian/copyright states them
    what: str  # what was taken, for NOTICE
    budget: int  # bytes of UTF-8 text to take
    exclude: tuple[str, ...] = ()
    script: str | None = None  # writing system a document must mostly use (see extract_text.SCRIPTS)
    min_script_share: float = 0.0  # documents below this share of letters in `script` are untranslated: skipped
    max_doc_bytes: int = 48_000  # longer documents are skipped whole rather than cut
    license_overrides: dict[str, str] = field(default_factory=dict)  # file name -> license, from debian/copyright
    drop_sections: tuple[str, ...] = ()  # man page section headings to leave out
    license_note: str = ""  # for NOTICE, where the license id alone does not say enough


def _l10n(package: str, version: str, lang: str, where: str, budget: int, script: str | None = None) -> Source:
    return Source(
        package=package,
        version=version,
        lang=lang,
        kind="man",
        include=(f"usr/share/man/{where}/man*/*",),
        license=L10N_LICENSE,
        holders=L10N_HOLDERS,
        what=L10N_WHAT.format(where=f"/usr/share/man/{where}"),
        budget=budget,
        script=script,
        min_script_share=0.5 if script else 0.0,
        drop_sections=(L10N_CREDITS_HEADING[lang],),
        license_note="debian/copyright puts the translations under GPL-3+; the English pages they translate "
        "carry their own free licenses (named in each page's source)",
    )


def _fortunes(
    package: str,
    version: str,
    lang: str,
    license: str,
    holders: str,
    budget: int,
    exclude: tuple[str, ...] = (),
    script: str | None = None,
    license_note: str = "",
) -> Source:
    return Source(
        package=package,
        version=version,
        lang=lang,
        kind="fortune",
        include=("usr/share/games/fortunes/**/*",),
        license=license,
        holders=holders,
        what="fortune cookies (quotations, proverbs, jokes, poems), about 20 per document",
        budget=budget,
        exclude=(*exclude, "*.dat"),  # strfile(1) index tables, not text
        script=script,
        min_script_share=0.5 if script else 0.0,
        license_note=license_note,
    )


SOURCES: tuple[Source, ...] = (
    # --- English -------------------------------------------------------------------------------------------
    Source(
        package="manpages",
        version="6.03-2",
        lang="en",
        kind="man",
        include=("usr/share/man/man*/*",),
        license="from-page",  # each page carries an SPDX-License-Identifier line; pages without one are skipped
        holders="2005-2021 Michael Kerrisk, 2022-2023 Alejandro Colomar, and the authors named in each page",
        what="Linux man-pages (mostly sections 4, 5 and 7), formatted to plain text with groff; one page per document",
        budget=650_000,
    ),
    Source(
        package="debian-faq",
        version="11.1",
        lang="en",
        kind="html",
        include=("usr/share/doc/debian/FAQ/*.en.html",),
        exclude=("usr/share/doc/debian/FAQ/index.en.html",),
        license="LicenseRef-Debian-FAQ",
        license_note="verbatim copies, and modified versions or translations under an identical permission "
        "notice, may be made and distributed (debian/copyright)",
        holders="1996-2003 Software in the Public Interest",
        what="The Debian GNU/Linux FAQ, HTML chapters converted to plain text; one chapter per document",
        budget=300_000,
    ),
    # --- German, French, Spanish, Italian, Polish, Portuguese, Russian (manpages-l10n) -----------------------
    _l10n("manpages-de", "4.18.1-1", "de", "de", 550_000),
    _fortunes(
        "fortunes-de",
        "0.35-1",
        "de",
        "GPL-2.0-or-later",
        "1999-2012 Andreas Tille",
        350_000,
        # "namen" and "vornamen" are one pun template repeated ~500 times
        exclude=("usr/share/games/fortunes/de/namen", "usr/share/games/fortunes/de/vornamen"),
    ),
    _l10n("manpages-fr", "4.18.1-1", "fr", "fr", 900_000),
    _l10n("manpages-es", "4.18.1-1", "es", "es", 550_000),
    _fortunes(
        "fortunes-es",
        "1.36",
        "es",
        "public-domain",
        "1999 Agustín Martín Domingo, 2000 Javier Fernández-Sanguino Peña (collection)",
        350_000,
        exclude=("usr/share/games/fortunes/es/off/*",),  # the "offensive" section
        license_note='debian/copyright: "All fortunes\' text and quotes are presumed to be in the public domain"; '
        "its GPL-2+ covers the package's code",
    ),
    _l10n("manpages-it", "4.18.1-1", "it", "it", 500_000),
    _fortunes(
        "fortunes-it",
        "1.99-4.1",
        "it",
        "public-domain",
        "the fortune-it maintainers (collection)",
        400_000,
        license_note='COPYING-POLICY in debian/copyright: "Consider this package freeware (public domain)"',
    ),
    _l10n("manpages-pl", "1:4.18.1-1", "pl", "pl", 550_000),
    # Files without the .u8 suffix are ISO-8859-2 duplicates of the .u8 ones; strict UTF-8 decoding drops them.
    _fortunes(
        "fortunes-pl",
        "0.0.20130525-3",
        "pl",
        "GPL-2.0-or-later",
        "2000-2010 LinuxPL and PLD teams",
        350_000,
        exclude=("usr/share/games/fortunes/pl/dowcipy-szowinistyczne*",),  # chauvinist jokes
    ),
    _l10n("manpages-pt-br", "4.18.1-1", "pt", "pt_BR", 600_000),
    _fortunes(
        "fortunes-br",
        "20220821",
        "pt",
        "GPL-2.0-or-later",
        "2000-2003 Eduardo Marcel Maçan, 2006-2008 Guilherme de S. Pastore, 2016-2022 Breno Leitao",
        300_000,
    ),
    _l10n("manpages-ru", "4.18.1-1", "ru", "ru", 550_000, script="Cyrl"),
    _fortunes("fortunes-ru", "1.52-3.1", "ru", "GPL-2.0-only", "2003 Pavel Maryanov", 350_000, script="Cyrl"),
    # --- Japanese --------------------------------------------------------------------------------------------
    Source(
        package="manpages-ja",
        version="0.5.0.0.20221215+dfsg-1",
        lang="ja",
        kind="man",
        include=("usr/share/man/ja/man*/*",),
        # debian/copyright: the JM Project adds no terms; each translation is under its original page's license.
        license="same-as-original-page",
        license_note="the JM Project adds no terms: each translated page is under its original page's DFSG-free "
        "license, named in the page's roff source",
        holders="JM Project translators; original authors as named in each page",
        what="Japanese manual pages, formatted to plain text with groff; one page per document",
        budget=900_000,
        script="Jpan",
        min_script_share=0.5,
    ),
    # --- Chinese ---------------------------------------------------------------------------------------------
    Source(
        package="manpages-zh",
        version="1.6.4.0-1",
        lang="zh",
        kind="man",
        include=("usr/share/man/zh_CN/man*/*", "usr/share/man/zh_TW/man*/*"),
        license="GFDL-1.2-or-later",
        holders="2000-2004 CMPP Project, 2005 Carlos Z.F. Liu, 2008 LI Daobing, 2008 Ji ZhengYu, 2016-2020 Boyuan Yang",
        what="Chinese (simplified and traditional) manual pages, formatted to plain text with groff; one page per "
        "document",
        budget=550_000,
        script="Hani",
        min_script_share=0.5,
        license_overrides={"kill.1": "GPL-2.0-only", "intro.6": "GPL-2.0-or-later", "epoll.7": "GPL-2.0-or-later"},
    ),
    _fortunes(
        "fortunes-zh",
        "2.98",
        "zh",
        "GPL-3.0-or-later",
        "2001-2009 Yu Guanghui, 2015-2019 Mo Zhou, 2020-2021 xiao sheng wen",
        350_000,
        script="Hani",
    ),
    # --- Arabic ----------------------------------------------------------------------------------------------
    # Debian ships no Arabic manual pages or fortunes; the Debian Administrator's Handbook has a Moroccan
    # community translation (ar-MA). It is partial: untranslated paragraphs stay English and are dropped.
    Source(
        package="debian-handbook",
        version="11.20220922",
        lang="ar",
        kind="html",
        include=("usr/share/doc/debian-handbook/html/ar-MA/*.html",),
        exclude=("usr/share/doc/debian-handbook/html/ar-MA/index.html",),
        license="GPL-2.0-or-later OR CC-BY-SA-3.0",
        holders="2003-2015 Raphaël Hertzog, 2006-2015 Roland Mas, 2013-2015 Freexian SARL; Arabic translators",
        what="The Debian Administrator's Handbook, Arabic (ar-MA) translation: translated paragraphs of each HTML "
        "page; one page per document",
        budget=900_000,
        script="Arab",
        min_script_share=0.5,
        max_doc_bytes=120_000,  # the handbook's pages are long sections
    ),
    # --- Source code -----------------------------------------------------------------------------------------
    Source(
        package="python3-click",
        version="8.1.3-2",
        lang="code",
        kind="code",
        include=("usr/lib/python3/dist-packages/click/*.py",),
        license="BSD-3-Clause",
        holders="2014 Pallets; 2001-2006 Gregory P. Ward (parser.py)",
        what="Python modules of the click package, one file per document",
        budget=150_000,
        max_doc_bytes=120_000,
    ),
    Source(
        package="python3-attr",
        version="22.2.0-1",
        lang="code",
        kind="code",
        include=("usr/lib/python3/dist-packages/attr/*.py",),
        license="MIT",
        holders="2015 Hynek Schlawack and the attrs contributors",
        what="Python modules of the attrs package, one file per document",
        budget=100_000,
        max_doc_bytes=120_000,
    ),
    Source(
        package="zlib1g-dev",
        version="1:1.2.13.dfsg-1",
        lang="code",
        kind="code",
        include=("usr/share/doc/zlib1g-dev/examples/*.[ch]", "usr/include/*.h"),
        license="Zlib",
        holders="1995-2013 Jean-loup Gailly and Mark Adler",
        what="C example programs and headers of zlib, one file per document",
        budget=200_000,
        max_doc_bytes=120_000,
    ),
    Source(
        package="libyaml-doc",
        version="0.2.5-1",
        lang="code",
        kind="code",
        include=("usr/share/doc/libyaml-dev/*.c", "usr/share/doc/libyaml-dev/*.c.gz"),
        license="MIT",
        holders="2006-2020 Kirill Simonov",
        what="C example programs of libyaml, one file per document",
        budget=60_000,
    ),
    Source(
        package="bash-completion",
        version="1:2.11-6",
        lang="code",
        kind="code",
        include=("usr/share/bash-completion/completions/*", "usr/share/bash-completion/bash_completion"),
        license="GPL-2.0-or-later",
        holders="2006-2008 Ian Macdonald, 2008-2018 Bash Completion Maintainers",
        what="bash completion scripts (shell), one file per document",
        budget=150_000,
        max_doc_bytes=120_000,
    ),
)
