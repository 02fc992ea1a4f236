"""One pair of models tested at several doses of clutter: does the arm's advantage over the base grow with the dose?

``scripts/study.py --also-eval D0 D1 ... --primary BASE:ARM`` evaluates every run on the test split of each data set
(the same objects in the same places at every dose, lowest dose first). Per seed s the models are the same at
every dose, so the interaction I_s = (arm - base top-1 at the last dose) - (arm - base at the first) is a
difference within one pair of models. This module reads, from those evaluations:

- the primary: I over the seeds (95% t-interval, p, MDE), its outcome under :func:`rule_outcome`, and how many
  seeds its per-seed spread asks for to detect the gain of interest;
- arm - base top-1 at each dose, and the trend: per seed the least-squares slope of arm - base over the dose steps
  0, 1, 2, ... (points of top-1 per step);
- image-level: per test image, the mean over seeds of (a_last - b_last) - (a_first - b_first) (1 for a right top-1),
  its mean over the images with a t-interval. It holds the trained models fixed: it speaks of these images, not of
  another training seed;
- localisation at each dose: the arm's pooling weight on the object (``pooling_object_mass``) in excess of three
  maps that cannot see the object (``content_chance``, ``position_prior_mass``, ``pooling_fixed_object_mass``), and
  against the base backbone's post-hoc rollout map (``rollout_box_mass``), paired by seed.

Pure functions of results.json records and per-image hits; :func:`dose_section` renders them for the report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from harness import stats
from harness.compare import format_ci, format_number, format_p

__all__ = ["INTEREST", "MARGIN", "MOST_SEEDS", "NULLS", "contrast_metric", "dose_section", "dose_series",
           "image_level", "null_outcome", "place_outcome", "rule_outcome", "trend_slope"]

INTEREST = 0.01  # the smallest gain of interest: one point of top-1
MARGIN = 0.02  # the smallest difference of interest in object mass
MOST_SEEDS = 12  # the notes' cap on the planned seeds
NULLS = ("content_chance", "position_prior_mass", "pooling_fixed_object_mass")  # maps blind to the object


def contrast_metric(names: Sequence[str]) -> str:
    """The per-run metric whose paired comparison is the interaction: top-1 at the last dose minus at the first."""
    return f"top1 on {names[-1]} - top1 on {names[0]}"


def rule_outcome(low: float, high: float, interest: float = INTEREST, verb: str = "grows") -> str:
    """The five exclusive outcomes of a 95% interval [low, high] of a gain (split on low, then on high). ``verb``
    names what a positive interval says: the interaction and the trend *grow*, a difference at one dose *gains*."""
    if low >= interest:
        return "pays"
    if low > 0:
        return f"{verb}, size open" if high >= interest else f"{verb}, below interest"
    return "open" if high >= interest else "no gain of interest"


def null_outcome(low: float, high: float) -> str:
    """An excess over a null: beats it (interval above 0), does not (at or below 0), or open."""
    return "beats the null" if low > 0 else "does not" if high <= 0 else "open"


def place_outcome(low: float, high: float, margin: float = MARGIN) -> str:
    """A difference in object mass: elsewhere (interval excludes 0), the same (contains 0, within ±margin), open."""
    if low > 0 or high < 0:
        return "looks elsewhere"
    return "looks where the base's rollout looks" if -margin <= low and high <= margin else "open"


def trend_slope(values: Sequence[float]) -> float:
    """Least-squares slope of ``values`` over the steps 0, 1, 2, ... (per step)."""
    return float(np.polyfit(np.arange(len(values), dtype=np.float64), np.asarray(values, dtype=np.float64), 1)[0])


def image_level(hits: Mapping[tuple[str, int, str], np.ndarray], base: str, arm: str, first: str, last: str,
                seeds: Sequence[int]) -> stats.TInterval:
    """Per image the mean over ``seeds`` of (arm - base hits at ``last``) - (arm - base at ``first``); their mean
    over the images with its t-interval. ``hits[arm, seed, dose]``: (N,) 1 where the top-1 is right."""
    d = np.mean([(hits[arm, s, last] - hits[base, s, last]) - (hits[arm, s, first] - hits[base, s, first])
                 for s in seeds], axis=0)
    return stats.t_interval(d.tolist())


def _gains(low: float, high: float) -> str:
    """:func:`rule_outcome` of a difference at one dose, which gains rather than grows."""
    return rule_outcome(low, high, verb="gains")


BOUNDS = (0.0, INTEREST, -INTEREST, MARGIN, -MARGIN)  # where the rules split


def _end(x: float) -> str:
    """An interval end at 4 decimals, or as many more (up to 8) as keep it on its side of every rule boundary, so
    that the printed interval gives the printed outcome (-0.000013 is not shown as -0.0000)."""
    for digits in range(4, 9):
        shown = round(x, digits)
        if all(np.sign(shown - b) == np.sign(x - b) for b in BOUNDS):
            break
    return f"{x:+.{digits}f}"


def _interval_row(label: str, values: Sequence[float], rule: Callable[[float, float], str]) -> str:
    """A table row: the mean of ``values`` over seeds with its interval, p, MDE and ``rule``'s outcome."""
    d = stats.t_interval(values)
    outcome = rule(d.low, d.high) if d.low is not None else "-"
    ci = "-" if d.low is None else f"[{_end(d.low)}, {_end(d.high)}]"
    return (f"| {label} | {d.n} | {format_number(d.mean, True)} | {ci} | {format_p(d.p)} | "
            f"{format_number(d.mde)} | {outcome} |")


HEAD = ["| | seeds | mean | 95% CI | p | MDE | outcome |", "|---|---:|---:|---|---:|---:|---|"]


def dose_section(base: str, arm: str, names: Sequence[str], seeds: Sequence[int],
                 results: Mapping[tuple[str, int, str], dict[str, Any]],
                 hits: Mapping[tuple[str, int, str], np.ndarray] | None = None) -> list[str]:
    """The report's dose section: ``results[arm, seed, dose]`` the results.json of each model at each dose
    (``names``, lowest first), ``hits`` the per-image top-1 hits for the image-level reading (optional)."""
    def metric(a: str, s: int, n: str, m: str) -> float | None:
        return results[a, s, n]["metrics"].get(m)

    gap = {(s, n): metric(arm, s, n, "top1") - metric(base, s, n, "top1") for s in seeds for n in names}
    first, last = names[0], names[-1]
    primary = [gap[s, last] - gap[s, first] for s in seeds]
    lines = ["## Dose", "", f"The same {base} and {arm} models of each seed tested on the test split of each data "
             f"set ({', '.join(f'`{n}`' for n in names)}; the same objects in the same places). Top-1 as fractions "
             f"(0.01 = one point); outcomes by the rules of the notes (gain of interest {INTEREST}, object-mass "
             f"margin {MARGIN}; at one dose a positive interval *gains* where the interaction and the trend *grow*); "
             "every row but the first secondary, uncorrected. An interval end shows more decimals where 4 would "
             "put it on the other side of a rule's boundary.", "", *HEAD,
             _interval_row(f"**primary**: ({arm} - {base} at {last}) - (at {first})", primary,
                           rule_outcome)]
    for n in names:
        values = [gap[s, n] for s in seeds]
        lines.append(_interval_row(f"{arm} - {base} at {n}", values, _gains))
    slopes = [trend_slope([gap[s, n] for n in names]) for s in seeds]
    lines.append(_interval_row(f"trend of {arm} - {base} per dose step", slopes, rule_outcome))
    lines.append("")
    shown = ", ".join(f"seed {s} {v:+.4f}" for s, v in zip(seeds, primary, strict=True))
    lines += [f"Per seed, the primary: {shown}.", *_seeds_needed(primary), ""]
    if hits is not None:
        d = image_level(hits, base, arm, first, last, seeds)
        lines += [f"Image-level, pooled over the {len(seeds)} seeds (the trained models held fixed): the mean over "
                  f"{d.n} images of the per-image interaction is {d.mean:+.4f} {format_ci(d)}.", ""]
    return [*lines, *_localisation_rows(base, arm, names, seeds, metric)]


def dose_series(base: str, arm: str, names: Sequence[str], seeds: Sequence[int],
                results: Mapping[tuple[str, int, str], dict[str, Any]]
                ) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """What the dose figure draws, per dose the per-seed values: ``arm - base`` top-1, and object masses (label ->
    dose -> values) of the arm's pooling weights, the base backbone's post-hoc rollout map and the three maps blind
    to the object; a mass only where every seed recorded it at every dose."""
    def metric(a: str, m: str, n: str) -> list[float | None]:
        return [results[a, s, n]["metrics"].get(m) for s in seeds]

    gains = {n: [r - b for r, b in zip(metric(arm, "top1", n), metric(base, "top1", n), strict=True)] for n in names}
    wanted = {f"{arm} pooling weights": (arm, "pooling_object_mass"),
              f"{base} backbone's post-hoc rollout map": (base, "rollout_box_mass"),
              f"{arm}'s mean weights as one fixed map": (arm, "pooling_fixed_object_mass"),
              "position prior (mean object coverage)": (arm, "position_prior_mass"),
              "content chance (avoids flat fill only)": (arm, "content_chance")}
    masses = {label: {n: metric(a, m, n) for n in names} for label, (a, m) in wanted.items()}
    return gains, {label: per for label, per in masses.items()
                   if all(v is not None for values in per.values() for v in values)}


def _seeds_needed(primary: Sequence[float]) -> list[str]:
    """How many seeds the primary's per-seed spread asks for, to detect the gain of interest (the notes' plan)."""
    if len(primary) < 2:
        return []
    sd = stats.t_interval(primary).sd
    n = stats.seeds_for_mde(sd, INTEREST, MOST_SEEDS)
    if n is None:
        return [f"At the primary's per-seed sd of {sd:.5f}, even {MOST_SEEDS} seeds give an MDE of only "
                f"{stats.min_detectable_effect(sd, MOST_SEEDS):.4f}, above the gain of interest {INTEREST}."]
    return [f"At the primary's per-seed sd of {sd:.5f}, {n} seeds give an MDE of at most the gain of interest "
            f"{INTEREST} ({stats.min_detectable_effect(sd, n):.4f})."]


def _localisation_rows(base: str, arm: str, names: Sequence[str], seeds: Sequence[int], metric) -> list[str]:
    """Per dose: the arm's object mass in excess of each null, and against the base backbone's rollout map."""
    if any(metric(arm, s, n, "pooling_object_mass") is None for s in seeds for n in names):
        return []
    lines = [f"Where {arm} pools, per dose: its `pooling_object_mass` in excess of each map blind to the object, and "
             f"minus the {base} backbone's post-hoc `rollout_box_mass` (the same rollout row on the {base}-trained "
             "backbone), per seed, mean with 95% t-interval.", "", *HEAD]
    for n in names:
        mass = {s: metric(arm, s, n, "pooling_object_mass") for s in seeds}
        lines.append(f"| {arm} `pooling_object_mass` at {n} | {len(seeds)} | "
                     f"{np.mean(list(mass.values())):.4f} | | | | |")
        for null in NULLS:
            values = [mass[s] - v for s in seeds if (v := metric(arm, s, n, null)) is not None]
            if len(values) == len(seeds):
                lines.append(_interval_row(f"- {null}", values, null_outcome))
        values = [mass[s] - v for s in seeds if (v := metric(base, s, n, "rollout_box_mass")) is not None]
        if len(values) == len(seeds):
            lines.append(_interval_row(f"- {base}'s `rollout_box_mass`", values, place_outcome))
    return [*lines, ""]
