"""Carbon facts about where a run happens: grid intensity and data-centre PUE, with their sources.

Energy figures in this project are IT energy (what the GPUs and CPUs draw); carbon is
    kg CO2eq = IT kWh x PUE (facility energy per IT energy) x grid intensity (g/kWh) / 1000.
A hardware profile may state its site's PUE and intensity (Jean Zay: 1.2 and 57 g/kWh); otherwise the world
average below applies; `--set carbon_profile=... grid_g_per_kwh=... pue=...` overrides either.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from appliance.errors import BadInput


@dataclass(frozen=True)
class CarbonProfile:
    name: str
    grid_g_per_kwh: float
    pue: float
    source: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The defaults, in one place. Without a profile we assume an average grid and an average data centre.
WORLD_AVERAGE = CarbonProfile(
    name="world-average",
    grid_g_per_kwh=475.0,  # IEA, Global Energy & CO2 Status Report 2019: world electricity, 475 gCO2/kWh
    pue=1.58,  # Uptime Institute, Global Data Center Survey 2023: average annual PUE 1.58
    source="IEA Global Energy & CO2 Status Report 2019 (475 g/kWh); Uptime Institute survey 2023 (PUE 1.58)",
)
# BLOOM-176B on Jean Zay: French grid (mostly nuclear) and the cluster's PUE, as the BLOOM carbon study used them.
BLOOM_JEAN_ZAY = CarbonProfile(
    name="bloom-jean-zay",
    grid_g_per_kwh=57.0,
    pue=1.2,
    source="Luccioni, Viguier & Ligozat 2022, Estimating the Carbon Footprint of BLOOM (arXiv:2211.02001)",
)
PROFILES = {p.name: p for p in (WORLD_AVERAGE, BLOOM_JEAN_ZAY)}
DEFAULT_PROFILE = WORLD_AVERAGE


def carbon_kg(kwh: float, grid_g_per_kwh: float, pue: float) -> float:
    """kg CO2eq of `kwh` IT energy: the facility draws kwh x PUE, each kWh emitting grid_g_per_kwh grams."""
    return kwh * pue * grid_g_per_kwh / 1000.0


def resolve_profile(
    name: str | None = None,
    *,
    grid_g_per_kwh: float | None = None,
    pue: float | None = None,
    site: CarbonProfile | None = None,
) -> CarbonProfile:
    """The profile a run uses: a named one, else the hardware profile's own site figures (`site`), else the
    world average; then the grid intensity and/or PUE overridden where given."""
    if name is not None:
        base = PROFILES.get(name)
        if base is None:
            raise BadInput(f"carbon profile {name!r} is unknown; known profiles: {', '.join(sorted(PROFILES))}")
    else:
        base = site or DEFAULT_PROFILE
    if grid_g_per_kwh is not None and not grid_g_per_kwh >= 0:
        raise BadInput(f"grid intensity must be >= 0 gCO2/kWh, got {grid_g_per_kwh}")
    if pue is not None and not pue >= 1.0:
        raise BadInput(f"PUE must be >= 1.0 (facility energy / IT energy), got {pue}")
    if grid_g_per_kwh is None and pue is None:
        return base
    return CarbonProfile(
        name=f"{base.name} (overridden)",
        grid_g_per_kwh=base.grid_g_per_kwh if grid_g_per_kwh is None else grid_g_per_kwh,
        pue=base.pue if pue is None else pue,
        source=f"{base.source}; overridden by the user",
    )


def site_profile(name: str, pue: float | None, kg_co2_per_kwh: float | None) -> CarbonProfile | None:
    """A hardware profile's own site figures, when it states both or either (the other from the default)."""
    if pue is None and kg_co2_per_kwh is None:
        return None
    return CarbonProfile(
        name=f"{name} site",
        grid_g_per_kwh=DEFAULT_PROFILE.grid_g_per_kwh if kg_co2_per_kwh is None else kg_co2_per_kwh * 1000.0,
        pue=DEFAULT_PROFILE.pue if pue is None else pue,
        source=f"hardware profile {name}",
    )
