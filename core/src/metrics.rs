//! Every metric name Ferry emits, in one place (DESIGN.md §8), with its help text and labels.
//! Code records through the `metrics` facade using these constants; [`describe`] registers the
//! help texts with whichever recorder (the Prometheus exporter) is installed.

/// Bytes of KV pages moved, by `backend` (counter).
pub const TRANSFER_BYTES: &str = "ferry_transfer_bytes_total";
/// Page runs moved, by `backend` (counter).
pub const TRANSFER_RUNS: &str = "ferry_transfer_runs_total";
/// Seconds one chunk's send took, from the first byte posted to the last acknowledged,
/// by `backend` (histogram).
pub const TRANSFER_CHUNK_SECONDS: &str = "ferry_transfer_chunk_seconds";
/// Throughput of the last chunk sent, bytes per second, by `backend` (gauge).
pub const TRANSFER_THROUGHPUT: &str = "ferry_transfer_throughput_bytes_per_second";
/// Rooms ended, by `backend`, `side` (sender | receiver), `outcome` (success | failed) and
/// `reason` (none | timeout | aborted | corrupt | peer_gone | refused) (counter).
pub const TRANSFER_ROOMS: &str = "ferry_transfer_rooms_total";
/// Frames or rooms a receiver refused, by `reason` (counter).
pub const TRANSFER_REFUSALS: &str = "ferry_transfer_refusals_total";
/// OpenAI request fields the router ignored, by `field` (well-known names, else `other`)
/// (counter).
pub const OPENAI_IGNORED_FIELDS: &str = "ferry_openai_ignored_fields_total";
/// Data-plane connections a receiver serves now (gauge).
pub const TRANSFER_CONNECTIONS: &str = "ferry_transfer_connections";
/// Data-plane connections a receiver dropped or failed to accept, by `reason` (counter).
pub const TRANSFER_CONNECTIONS_REFUSED: &str = "ferry_transfer_connections_refused_total";
/// Prompt pages a decode node's prefix cache held, so that no transfer sent them (counter).
pub const TRANSFER_PAGES_HELD: &str = "ferry_transfer_pages_held_total";
/// The transfer backend in use: 1 for the `backend` chosen, with the `requested` one (gauge).
pub const TRANSFER_BACKEND: &str = "ferry_transfer_backend";
/// Prompt pages pulled from a decode node's prefix cache into a prefill node's, by `role`
/// (decode: lent and sent; prefill: received and cached) (counter).
pub const PULL_PAGES: &str = "ferry_pull_pages_total";
/// Pulls a prefill node made, by `outcome`: `ok`, or `failed` (the prompt was then computed
/// whole) (counter).
pub const PULLS: &str = "ferry_pulls_total";
/// Bytes of KV pages copied between a device pool and its host mirror, by `role` and
/// `direction` (to_host | to_device) (counter).
pub const KV_MIRROR_BYTES: &str = "ferry_kv_mirror_bytes_total";
/// Seconds one batch of mirror copies took, by `role` and `direction` (histogram).
pub const KV_MIRROR_SECONDS: &str = "ferry_kv_mirror_seconds";

/// Requests in each queue state of a worker, by `role` (prefill | decode), `worker` and
/// `state` (bootstrap | waiting | inflight | prealloc | transfer | running | prefill) (gauge).
pub const QUEUE_DEPTH: &str = "ferry_queue_depth";
/// KV pages of a worker by `kind` (free | used | evictable | total) (gauge).
pub const PAGES: &str = "ferry_pages";
/// Requests a worker finished, by `role` and `outcome` (stop | length | abort | error) (counter).
pub const REQUESTS: &str = "ferry_requests_total";
/// Requests or calls a worker refused as bad input, by `role` and `reason` (counter).
pub const BAD_REQUESTS: &str = "ferry_bad_requests_total";
/// 1 while a daemon in this process runs its internal gRPC in plaintext
/// (`--insecure-internal`) (gauge).
pub const INSECURE_INTERNAL: &str = "ferry_insecure_internal";
/// Prompt tokens a prefill worker found in its prefix cache (counter).
pub const PREFIX_HIT_TOKENS: &str = "ferry_prefix_hit_tokens_total";
/// Prompt tokens a worker computed (counter), by `role`.
pub const PREFILL_TOKENS: &str = "ferry_prefill_tokens_total";
/// Tokens a decode worker generated (counter).
pub const GENERATED_TOKENS: &str = "ferry_generated_tokens_total";
/// Seconds one forward pass took, by `role` (histogram).
pub const STEP_SECONDS: &str = "ferry_step_seconds";
/// Times a worker's engine thread woke (a command, a deadline, or a step with work to do).
pub const ENGINE_WAKEUPS: &str = "ferry_engine_wakeups_total";
/// Requests decoding in one decode step, by `worker` (histogram).
pub const DECODE_BATCH: &str = "ferry_decode_batch_requests";
/// Running requests a decode worker retracted (pages freed, the request re-queued to be
/// recomputed), by `worker` and `reason` (out_of_pages) (counter).
pub const RETRACTIONS: &str = "ferry_decode_retractions_total";
/// KV tokens retractions dropped, computed again when their requests resume, by `worker`
/// (counter).
pub const RETRACTED_TOKENS: &str = "ferry_decode_retracted_tokens_total";
/// Output tokens a constraint forced and the decode node appended without sampling them.
pub const JUMP_FORWARD_TOKENS: &str = "ferry_decode_jump_forward_tokens_total";
/// Seconds from a request's retraction to its next decode step (histogram).
pub const RETRACTION_PAUSE: &str = "ferry_decode_retraction_pause_seconds";
/// The decode admission estimate: the share of a request's remaining max tokens whose pages
/// admission sets aside, by `worker` (gauge).
pub const NEW_TOKEN_RATIO: &str = "ferry_decode_new_token_ratio";

/// Requests the router placed, by `target` (prefill | local: the decode worker prefills) and
/// `worker` (the prefill worker, or the decode worker for local) (counter).
pub const ROUTER_PLACEMENTS: &str = "ferry_router_placements_total";
/// Requests the router placed on each decode `worker` (retries on another decode worker
/// included) (counter).
pub const ROUTER_DECODE_PLACEMENTS: &str = "ferry_router_decode_placements_total";
/// Requests placed on a decode worker whose cache holds more of the prompt than the prefill
/// worker's, by `choice`: `local` (the decode worker prefills only what it lacks),
/// `prefill` (a prefill worker computes the prompt; only the pages the decode worker lacks
/// are sent) or `pull` (the prefill worker pulls what the decode worker holds and computes
/// the rest) (counter).
pub const ROUTER_DECODE_PREFIX: &str = "ferry_router_decode_prefix_total";
/// Requests retried elsewhere after a worker failed before the first token, by `stage`
/// (prefill | decode) and the `worker` that failed (a decode worker prefilling locally counts
/// under stage prefill) (counter).
pub const ROUTER_RETRIES: &str = "ferry_router_retries_total";
/// Streams whose decode worker failed after tokens went out, by `outcome`: `resumed` (moved
/// to another decode worker, the stream going on), `failed` (no other worker took it),
/// `limit` (`--migration-limit` moves used up), `unsupported` (`n` > 1) (counter).
pub const ROUTER_MIGRATIONS: &str = "ferry_router_migrations_total";
/// Requests the router finished, by `outcome` (stop | length | abort | error | cancelled | refused)
/// (counter).
pub const ROUTER_REQUESTS: &str = "ferry_router_requests_total";
/// Seconds from a request's arrival at the router to its first token (histogram).
pub const ROUTER_TTFT: &str = "ferry_router_ttft_seconds";
/// Seconds between two streamed pieces of one answer at the router (inter-token latency)
/// (histogram).
pub const ROUTER_ITL: &str = "ferry_router_itl_seconds";
/// Seconds one request spent in one phase on one daemon, by `role` and `phase` (see
/// `ferry_cluster::phases`) (histogram).
pub const REQUEST_PHASE: &str = "ferry_request_phase_seconds";
/// Prompt tokens of the router's finished requests, by `kind` (prompt | cached) (counter).
pub const ROUTER_PROMPT_TOKENS: &str = "ferry_router_prompt_tokens_total";
/// Workers the router knows, by `role` and `state` (healthy | unhealthy) (gauge).
pub const ROUTER_WORKERS: &str = "ferry_router_workers";
/// Pages in the router's prefix indexes, by `role` (prefill | decode: whose caches) and
/// `state` (confirmed by a worker's KV events | provisional: placed by the router, its mark
/// not lapsed; a page can be both) (gauge).
pub const ROUTER_INDEX_PAGES: &str = "ferry_router_index_pages";
/// Pages a router's prefix index (`role`) evicted, least recently used first, to make room
/// (counter).
pub const ROUTER_INDEX_EVICTED: &str = "ferry_router_index_evicted_pages_total";
/// New pages a router's prefix index (`role`) dropped because it was full of pages it could
/// not evict (counter).
pub const ROUTER_INDEX_DROPPED: &str = "ferry_router_index_dropped_pages_total";
/// Writes after which the two copies of a router's events index (`role`) may answer
/// differently: a bug in the router, never expected (counter; a write is checked when the
/// next one makes its changes again in the other copy).
pub const ROUTER_INDEX_DIVERGED: &str = "ferry_router_index_diverged_writes_total";
/// Prompt tokens the router's tokenizer took from its head cache (`kind` = hit) or
/// tokenized (`kind` = miss) (counter).
pub const ROUTER_TOKENIZER_CACHE_TOKENS: &str = "ferry_router_tokenizer_cache_tokens_total";
/// Bytes the router's tokenizer head cache holds (gauge).
pub const ROUTER_TOKENIZER_CACHE_BYTES: &str = "ferry_router_tokenizer_cache_bytes";
/// Requests through the router's admission queue, by `outcome` (immediate | queued |
/// queue_full | timeout) (counter).
pub const ROUTER_ADMISSION: &str = "ferry_router_admission_total";
/// Requests waiting in the router's admission queue (gauge).
pub const ROUTER_QUEUED: &str = "ferry_router_queued_requests";
/// Requests holding an admission slot in the router now: running (gauge).
pub const ROUTER_RUNNING: &str = "ferry_router_running_requests";
/// Seconds a request admitted from the queue waited there (histogram).
pub const ROUTER_QUEUE_SECONDS: &str = "ferry_router_queue_seconds";
/// etcd streams that broke and were set up again, by `stream` (watch: a router's view of the
/// workers | lease: a worker's registration) (counter).
pub const ETCD_RECONNECTS: &str = "ferry_etcd_reconnects_total";

/// A metric's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up.
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution.
    Histogram,
}

/// One metric: name, type, labels, help text.
#[derive(Debug, Clone, Copy)]
pub struct Metric {
    /// Its name.
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Its labels, comma-separated.
    pub labels: &'static str,
    /// Its help text.
    pub help: &'static str,
}

const fn m(name: &'static str, kind: Kind, labels: &'static str, help: &'static str) -> Metric {
    Metric { name, kind, labels, help }
}

/// Every metric Ferry emits (the operations guide's list is generated from this).
pub const ALL: &[Metric] = &[
    m(
        QUEUE_DEPTH,
        Kind::Gauge,
        "role, worker, state",
        "Requests per queue state (bootstrap, waiting, inflight / prealloc, transfer, prefill, waiting, running)",
    ),
    m(PAGES, Kind::Gauge, "role, worker, kind", "KV pages by kind (free, used, evictable, total)"),
    m(
        REQUESTS,
        Kind::Counter,
        "role, outcome",
        "Requests a worker finished (stop, length, abort, error); on decode workers each of a request's n sequences counts",
    ),
    m(
        BAD_REQUESTS,
        Kind::Counter,
        "role, reason",
        "Calls refused as bad input (incl. the router's 4xx and failed TLS handshakes)",
    ),
    m(INSECURE_INTERNAL, Kind::Gauge, "", "1 while a daemon runs its internal gRPC in plaintext (--insecure-internal)"),
    m(
        PREFIX_HIT_TOKENS,
        Kind::Counter,
        "role",
        "Prompt tokens found in the prefix cache (decode: also a retracted request's context found again)",
    ),
    m(PREFILL_TOKENS, Kind::Counter, "role", "Prompt tokens computed"),
    m(GENERATED_TOKENS, Kind::Counter, "role", "Tokens generated by decode workers"),
    m(STEP_SECONDS, Kind::Histogram, "role", "Forward pass time, seconds"),
    m(
        ENGINE_WAKEUPS,
        Kind::Counter,
        "role, worker",
        "Engine thread wake-ups: a command, a queue deadline, or a step with work (an idle worker does not poll)",
    ),
    m(DECODE_BATCH, Kind::Histogram, "worker", "Requests decoding in one decode step"),
    m(
        RETRACTIONS,
        Kind::Counter,
        "worker, reason",
        "Running requests retracted to free KV pages, resumed later by recomputation (out_of_pages)",
    ),
    m(
        RETRACTED_TOKENS,
        Kind::Counter,
        "worker",
        "KV tokens retractions took from requests (computed again on resume, but what the decode node's prefix cache still holds)",
    ),
    m(
        JUMP_FORWARD_TOKENS,
        Kind::Counter,
        "worker",
        "output tokens a constraint forced, appended in one step without sampling (jump-forward)",
    ),
    m(RETRACTION_PAUSE, Kind::Histogram, "", "Time from a retraction to the request's next decode step, seconds"),
    m(
        NEW_TOKEN_RATIO,
        Kind::Gauge,
        "worker",
        "Decode admission estimate: share of a request's remaining max tokens set aside in pages",
    ),
    m(TRANSFER_BYTES, Kind::Counter, "backend", "KV page bytes moved"),
    m(TRANSFER_RUNS, Kind::Counter, "backend", "KV page runs moved"),
    m(TRANSFER_CHUNK_SECONDS, Kind::Histogram, "backend", "Time to send one chunk's pages, seconds"),
    m(TRANSFER_THROUGHPUT, Kind::Gauge, "backend", "Bytes per second of the last chunk sent"),
    m(
        TRANSFER_ROOMS,
        Kind::Counter,
        "backend, side, outcome, reason",
        "Transfer rooms ended (reason: none, timeout, aborted, corrupt, peer_gone, refused)",
    ),
    m(TRANSFER_REFUSALS, Kind::Counter, "reason", "Frames or rooms refused by a receiver"),
    m(OPENAI_IGNORED_FIELDS, Kind::Counter, "field", "OpenAI request fields ignored (well-known names, else other)"),
    m(TRANSFER_CONNECTIONS, Kind::Gauge, "", "Data-plane connections a receiver serves now"),
    m(
        TRANSFER_CONNECTIONS_REFUSED,
        Kind::Counter,
        "reason",
        "Data-plane connections dropped at the cap (at_cap), failed accepts (accept_error, retried after 100 ms), failed TLS handshakes (tls_handshake) or peers of the wrong role (wrong_role)",
    ),
    m(
        PULL_PAGES,
        Kind::Counter,
        "role",
        "Prompt pages pulled from a decode node's prefix cache (decode: sent; prefill: received and cached)",
    ),
    m(PULLS, Kind::Counter, "outcome", "Pulls of held pages a prefill node made (outcome: ok, failed)"),
    m(
        TRANSFER_PAGES_HELD,
        Kind::Counter,
        "",
        "Prompt pages the decode node's prefix cache held, so no transfer sent them (delta transfer)",
    ),
    m(TRANSFER_BACKEND, Kind::Gauge, "backend, requested", "Transfer backend in use (1), with the one requested"),
    m(
        KV_MIRROR_BYTES,
        Kind::Counter,
        "role, direction",
        "KV page bytes copied between a device pool and its host mirror (to_host, to_device)",
    ),
    m(KV_MIRROR_SECONDS, Kind::Histogram, "role, direction", "Time of one batch of mirror copies, seconds"),
    m(
        ROUTER_DECODE_PREFIX,
        Kind::Counter,
        "choice",
        "Requests whose decode worker holds more of the prompt than the prefill worker (choice: local, prefill, pull)",
    ),
    m(
        ROUTER_PLACEMENTS,
        Kind::Counter,
        "target, worker",
        "Requests placed (target: prefill, or local on the decode worker)",
    ),
    m(ROUTER_DECODE_PLACEMENTS, Kind::Counter, "worker", "Requests placed on each decode worker (retries included)"),
    m(
        ROUTER_RETRIES,
        Kind::Counter,
        "stage, worker",
        "Requests retried on another worker after `worker` failed before the first token (stage: prefill, decode)",
    ),
    m(
        ROUTER_MIGRATIONS,
        Kind::Counter,
        "outcome",
        "Streams whose decode worker failed after tokens went out (outcome: resumed, failed, limit, unsupported)",
    ),
    m(
        ROUTER_REQUESTS,
        Kind::Counter,
        "outcome",
        "Requests finished by the router (stop, length, abort, error, cancelled, refused)",
    ),
    m(ROUTER_TTFT, Kind::Histogram, "", "Time from arrival at the router to the first token, seconds"),
    m(
        REQUEST_PHASE,
        Kind::Histogram,
        "role, phase",
        "Time one request spent in one phase on one daemon, seconds (router: tokenize, queue, placement, first_token, decode; prefill: prefill_queue, prefill_compute, transfer; decode: admission, transfer, local_prefill, first_token, decode, retracted)",
    ),
    m(ROUTER_ITL, Kind::Histogram, "", "Time between two streamed pieces of one answer (inter-token latency), seconds"),
    m(ROUTER_PROMPT_TOKENS, Kind::Counter, "kind", "Prompt tokens of finished requests (prompt, cached)"),
    m(ROUTER_WORKERS, Kind::Gauge, "role, state", "Workers known to the router (healthy, unhealthy)"),
    m(
        ROUTER_INDEX_PAGES,
        Kind::Gauge,
        "role, state",
        "Pages in the router's prefix indexes (role: whose caches; state: confirmed, provisional)",
    ),
    m(ROUTER_INDEX_EVICTED, Kind::Counter, "role", "Pages a router's prefix index evicted to make room"),
    m(ROUTER_INDEX_DROPPED, Kind::Counter, "role", "New pages a router's prefix index dropped, full"),
    m(ROUTER_INDEX_DIVERGED, Kind::Counter, "role", "Writes after which the index's two copies may differ (a bug)"),
    m(
        ROUTER_TOKENIZER_CACHE_TOKENS,
        Kind::Counter,
        "kind",
        "Prompt tokens taken from the tokenizer's head cache (hit) or tokenized (miss)",
    ),
    m(ROUTER_TOKENIZER_CACHE_BYTES, Kind::Gauge, "", "Bytes the tokenizer's head cache holds"),
    m(
        ROUTER_ADMISSION,
        Kind::Counter,
        "outcome",
        "Requests through the admission queue (immediate, queued, queue_full, timeout)",
    ),
    m(ROUTER_QUEUED, Kind::Gauge, "", "Requests waiting in the admission queue"),
    m(ROUTER_RUNNING, Kind::Gauge, "", "Requests holding an admission slot (running)"),
    m(ROUTER_QUEUE_SECONDS, Kind::Histogram, "", "Time a queued request waited for a slot, seconds"),
    m(
        ETCD_RECONNECTS,
        Kind::Counter,
        "stream",
        "etcd streams broken and set up again (watch: the router's view of the workers; lease: a worker's registration)",
    ),
];

/// Registers help texts for every metric with the installed recorder.
pub fn describe() {
    for x in ALL {
        match x.kind {
            Kind::Counter => metrics::describe_counter!(x.name, x.help),
            Kind::Gauge => metrics::describe_gauge!(x.name, x.help),
            Kind::Histogram => metrics::describe_histogram!(x.name, x.help),
        }
    }
}

/// The operations guide's metrics table (Markdown).
pub fn markdown() -> String {
    let mut s = String::from("| metric | type | labels | meaning |\n|---|---|---|---|\n");
    for x in ALL {
        let kind = format!("{:?}", x.kind).to_ascii_lowercase();
        s += &format!("| `{}` | {kind} | {} | {} |\n", x.name, x.labels, x.help);
    }
    s
}
