"""What remote reads cost, and what the cache saved: DELI's cost model with a price table.

DELI (IC2E'21, section III-C) prices bucket access as *requests × per-request price* (Class A
for listings, Class B for reads, on GCS) plus, where data leaves the region, *bytes × egress
price*. We apply the same model to what mountd counted:

* cost of what the remote served = Σ requests[kind] × price(kind) + bytes_from_remote × egress
* saved by the cache = what the hits would have cost had they been misses:
  hits × price(GET) + bytes_from_cache × egress (one GET per hit file: a lower bound for files
  larger than one ranged read, 8 MiB).

Prices are list prices of each cloud's standard tier in its reference region, first usage
tier, in US dollars, as of :data:`PRICES_AS_OF` (sources in :data:`SOURCES`,
``docs/operations.md`` has the table). Egress is the internet egress price: a machine in the
bucket's own region pays no egress, so :func:`estimate` takes ``in_region=True`` to drop it.
``file://`` (local or shared file systems) costs nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

#: The date the prices below were taken from the providers' pages.
PRICES_AS_OF = "2025-06-01"

#: Where each price table comes from.
SOURCES = {
    "s3": "https://aws.amazon.com/s3/pricing/ (S3 Standard, us-east-1; data transfer out to internet, first 10 TB/month)",
    "az": "https://azure.microsoft.com/pricing/details/storage/blobs/ (Block blob, Hot, LRS, East US; bandwidth pricing, internet egress first 10 TB/month)",
    "gs": "https://cloud.google.com/storage/pricing (Standard storage, us-central1; Class A/B operations; internet egress, premium tier, first 1 TB/month)",
    "file": "local or shared file system: no request or egress charges",
}

GB = 1_000_000_000  # providers bill egress per GB of 10^9 bytes (AWS and Azure; GCS per GiB, see docs)


@dataclass(frozen=True, slots=True)
class PriceTable:
    """One cloud's prices in US dollars."""

    #: Cloud name for display.
    name: str
    #: Per 1,000 read requests (GET, and HEAD which is billed in the same class).
    read_per_1000: float
    #: Per 1,000 listing requests (S3 LIST, Azure List, GCS Class A).
    list_per_1000: float
    #: Per GB (10^9 bytes) leaving the region to the internet.
    egress_per_gb: float

    def request_price(self, kind: str) -> float:
        """Price of one request of ``kind`` (``GET``, ``HEAD``, ``LIST``; others priced as reads)."""
        per_1000 = self.list_per_1000 if kind.upper() == "LIST" else self.read_per_1000
        return per_1000 / 1000.0


#: URL scheme → prices. S3: GET $0.0004/1k, LIST $0.005/1k, egress $0.09/GB. Azure Hot LRS:
#: read $0.0044/10k, list $0.065/10k (the write-class price lists are billed at), egress
#: $0.087/GB. GCS Standard: Class B $0.004/10k, Class A $0.05/10k, egress $0.12/GB.
PRICES: dict[str, PriceTable] = {
    "s3": PriceTable("AWS S3", read_per_1000=0.0004, list_per_1000=0.005, egress_per_gb=0.09),
    "az": PriceTable("Azure Blob", read_per_1000=0.00044, list_per_1000=0.0065, egress_per_gb=0.087),
    "gs": PriceTable("Google Cloud Storage", read_per_1000=0.0004, list_per_1000=0.005, egress_per_gb=0.12),
    "file": PriceTable("file system", read_per_1000=0.0, list_per_1000=0.0, egress_per_gb=0.0),
}


def scheme_of(url: str) -> str:
    """The scheme part of a backend URL (``"s3://b/p"`` → ``"s3"``); plain paths are ``file``."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def prices_for(scheme: str) -> PriceTable | None:
    """The price table for ``scheme``, or None when it is unknown (cost then not estimated)."""
    return PRICES.get(scheme.lower())


def request_cost(prices: PriceTable, requests: Mapping[str, int]) -> float:
    """Σ requests[kind] × price(kind), in dollars."""
    return sum(count * prices.request_price(kind) for kind, count in requests.items())


def egress_cost(prices: PriceTable, nbytes: int, *, in_region: bool = False) -> float:
    """``nbytes`` of egress in dollars (0 when the reader is in the bucket's region)."""
    return 0.0 if in_region else nbytes / GB * prices.egress_per_gb


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """The cost model applied to one dataset (or the total) over mountd's counters."""

    #: Scheme the prices were taken for ("" when unknown or mixed: then costs are None).
    scheme: str
    #: Remote requests the hits avoided (one GET per hit).
    requests_saved: int
    #: Bytes the cache served instead of the remote.
    bytes_saved: int
    #: Dollars the remote reads cost (requests + egress), None when not priced.
    remote_cost: float | None
    #: Dollars the hits would have cost, None when not priced.
    cost_saved: float | None

    def to_json(self) -> dict:
        return asdict(self)


def estimate(
    scheme: str,
    *,
    hits: int,
    bytes_from_cache: int,
    remote_requests: Mapping[str, int],
    bytes_from_remote: int,
    in_region: bool = False,
) -> CostEstimate:
    """DELI's model over one set of counters; costs are None when ``scheme`` has no prices."""
    prices = prices_for(scheme) if scheme else None
    if prices is None:
        return CostEstimate(scheme, hits, bytes_from_cache, None, None)
    remote = request_cost(prices, remote_requests) + egress_cost(
        prices, bytes_from_remote, in_region=in_region
    )
    saved = request_cost(prices, {"GET": hits}) + egress_cost(
        prices, bytes_from_cache, in_region=in_region
    )
    return CostEstimate(scheme, hits, bytes_from_cache, remote, saved)


def price_table_rows() -> list[dict]:
    """The price table as rows (for docs and ``--json``)."""
    return [
        {"scheme": scheme, **asdict(table), "source": SOURCES[scheme], "as_of": PRICES_AS_OF}
        for scheme, table in PRICES.items()
    ]


# -- the stats report: counters + hit ratio + savings, per dataset and in total ---------------


def _latency(hist: Mapping | None) -> dict:
    """Count, mean and an upper bound of the 95th percentile from a per-bucket histogram, and
    the exact median and 95th percentile of the latest fills when the histogram has them."""
    hist = hist or {}
    recent = hist.get("recent") or {}
    count = int(hist.get("count", 0))
    mean = hist.get("sum", 0.0) / count if count else None
    p95 = None
    if count:
        seen = 0
        for bound, n in (hist.get("buckets") or {}).items():
            seen += n
            if seen >= 0.95 * count:
                p95 = None if bound == "+Inf" else float(bound)
                break
    return {"count": count, "mean_s": mean, "p95_le_s": p95,
            "p50_s": recent.get("p50"), "p95_s": recent.get("p95")}


def _row(counters: Mapping, schemes: list[str], in_region: bool) -> dict:
    hits = int(counters.get("hits", 0))
    misses = int(counters.get("misses", 0))
    requests = {k: int(v) for k, v in (counters.get("remote_requests") or {}).items()}
    scheme = schemes[0] if len(schemes) == 1 else ""
    cost = estimate(
        scheme,
        hits=hits,
        bytes_from_cache=int(counters.get("bytes_from_cache", 0)),
        remote_requests=requests,
        bytes_from_remote=int(counters.get("remote_bytes", counters.get("bytes_from_remote", 0))),
        in_region=in_region,
    )
    return {
        "hits": hits,
        "misses": misses,
        "prefetches": int(counters.get("prefetches", 0)),
        "prefetches_dropped": int(counters.get("prefetches_dropped", 0)),
        "hit_ratio": hits / (hits + misses) if hits + misses else None,
        "bytes_from_cache": int(counters.get("bytes_from_cache", 0)),
        "bytes_from_remote": int(counters.get("bytes_from_remote", 0)),
        "remote_requests": requests,
        "verify_failures": int(counters.get("verify_failures", 0)),
        "fill_errors": int(counters.get("fill_errors", 0)),
        "evicted_files": int(counters.get("evicted_files", 0)),
        "evicted_bytes": int(counters.get("evicted_bytes", 0)),
        "chunk_fills": int(counters.get("chunk_fills", 0)),
        "chunk_members": int(counters.get("chunk_members", 0)),
        "fill_latency": _latency(counters.get("fill_latency")),
        "schemes": schemes,
        **cost.to_json(),
    }


def stats_report(stats: Mapping, *, in_region: bool = False) -> dict:
    """What ``quiverfs stats`` shows, from mountd's ``stats`` answer.

    Each row (``total`` and one per dataset) has the counters, the hit ratio
    hits / (hits + misses), and DELI's savings priced with the scheme its fills used. A dataset
    with no known scheme, or with several, is not priced (``cost_saved`` is None). The total is
    priced directly when everything used one scheme, else it is the sum of the priced datasets
    (``total_priced_partially`` says when some traffic could not be priced).
    """
    counters = stats.get("counters") or {}
    schemes = stats.get("schemes") or {}
    per_schemes = schemes.get("datasets") or {}
    datasets = {
        name: _row(c, list(per_schemes.get(name, [])), in_region)
        for name, c in (counters.get("datasets") or {}).items()
    }
    total = _row(counters.get("total") or {}, list(schemes.get("total", [])), in_region)
    partial = False
    if total["cost_saved"] is None and datasets:
        priced = [r for r in datasets.values() if r["cost_saved"] is not None]
        if priced:
            total["cost_saved"] = sum(r["cost_saved"] for r in priced)
            total["remote_cost"] = sum(r["remote_cost"] for r in priced)
            partial = len(priced) < len(datasets) or sum(r["hits"] for r in priced) < total["hits"]
    return {
        "total": total,
        "datasets": datasets,
        "total_priced_partially": partial,
        "in_region": in_region,
        "prices_as_of": PRICES_AS_OF,
        "server": dict(stats.get("server") or {}),
        "fills_in_flight": counters.get("fills_in_flight", 0),
    }
