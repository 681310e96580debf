//! Every environment variable a Ferry command reads for a flag, named once: each flag's
//! `#[arg(env = ...)]` names one of these, and `ferry`'s reference test checks that no
//! command reads one twice and that a name several commands read has one default everywhere
//! (one name, one meaning). The flag tables in docs/operations.md list them per command.

/// `--advertise-addr` (ferry prefill, ferry decode).
pub const ADVERTISE_ADDR: &str = "FERRY_ADVERTISE_ADDR";

/// `--api-key` (ferry bench).
pub const API_KEY: &str = "FERRY_API_KEY";

/// `--api-key` (ferry router).
pub const API_KEYS: &str = "FERRY_API_KEYS";

/// `--bootstrap-timeout` (ferry prefill, ferry decode).
pub const BOOTSTRAP_TIMEOUT: &str = "FERRY_BOOTSTRAP_TIMEOUT";

/// `--cache-dir` (ferry model fetch; ferry up).
pub const CACHE_DIR: &str = "FERRY_CACHE_DIR";

/// `--chunked-prefill-size` (ferry prefill, ferry decode).
pub const CHUNKED_PREFILL_SIZE: &str = "FERRY_CHUNKED_PREFILL_SIZE";

/// `--cluster` (ferry prefill, ferry decode; ferry router).
pub const CLUSTER: &str = "FERRY_CLUSTER";

/// `--cpu-math` (ferry generate; ferry prefill, ferry decode; ferry up).
pub const CPU_MATH: &str = "FERRY_CPU_MATH";

/// `--decode` (ferry router).
pub const DECODE: &str = "FERRY_DECODE";

/// `--decode-admission` (ferry decode).
pub const DECODE_ADMISSION: &str = "FERRY_DECODE_ADMISSION";

/// `--max-running-requests` (ferry decode).
pub const DECODE_MAX_RUNNING_REQUESTS: &str = "FERRY_DECODE_MAX_RUNNING_REQUESTS";
/// `--decode-request-tokens` (ferry router).
pub const DECODE_REQUEST_TOKENS: &str = "FERRY_DECODE_REQUEST_TOKENS";

/// `--drain-grace` (ferry decode).
pub const DRAIN_GRACE: &str = "FERRY_DRAIN_GRACE";

/// `--disable-jump-forward` (ferry decode).
pub const DISABLE_JUMP_FORWARD: &str = "FERRY_DISABLE_JUMP_FORWARD";

/// `--disable-decode-cache` (ferry decode).
pub const DISABLE_DECODE_CACHE: &str = "FERRY_DISABLE_DECODE_CACHE";

/// `--disable-pull` (ferry router).
pub const DISABLE_PULL: &str = "FERRY_DISABLE_PULL";

/// `--device` (ferry generate; ferry prefill, ferry decode; ferry up).
pub const DEVICE: &str = "FERRY_DEVICE";

/// `--dtype` (ferry prefill, ferry decode).
pub const DTYPE: &str = "FERRY_DTYPE";

/// `--etcd` (ferry prefill, ferry decode; ferry router).
pub const ETCD: &str = "FERRY_ETCD";

/// `--etcd-ca` (ferry prefill, ferry decode; ferry router).
pub const ETCD_CA: &str = "FERRY_ETCD_CA";

/// `--etcd-cert` (ferry prefill, ferry decode; ferry router).
pub const ETCD_CERT: &str = "FERRY_ETCD_CERT";

/// `--etcd-key` (ferry prefill, ferry decode; ferry router).
pub const ETCD_KEY: &str = "FERRY_ETCD_KEY";

/// `--etcd-lease-ttl` (ferry prefill, ferry decode).
pub const ETCD_LEASE_TTL: &str = "FERRY_ETCD_LEASE_TTL";

/// `--etcd-password-file` (ferry prefill, ferry decode; ferry router).
pub const ETCD_PASSWORD_FILE: &str = "FERRY_ETCD_PASSWORD_FILE";

/// `--etcd-user` (ferry prefill, ferry decode; ferry router).
pub const ETCD_USER: &str = "FERRY_ETCD_USER";

/// `--grpc-addr` (ferry prefill, ferry decode; ferry router).
pub const GRPC_ADDR: &str = "FERRY_GRPC_ADDR";

/// `--http-addr` (ferry router).
pub const HTTP_ADDR: &str = "FERRY_HTTP_ADDR";

/// `--init-new-token-ratio` (ferry decode).
pub const INIT_NEW_TOKEN_RATIO: &str = "FERRY_INIT_NEW_TOKEN_RATIO";

/// `--insecure-internal` (every daemon).
pub const INSECURE_INTERNAL: &str = "FERRY_INSECURE_INTERNAL";

/// `--internal-tls-ca` (every daemon).
pub const INTERNAL_TLS_CA: &str = "FERRY_INTERNAL_TLS_CA";

/// `--internal-tls-cert` (every daemon).
pub const INTERNAL_TLS_CERT: &str = "FERRY_INTERNAL_TLS_CERT";

/// `--internal-tls-key` (every daemon).
pub const INTERNAL_TLS_KEY: &str = "FERRY_INTERNAL_TLS_KEY";

/// `--internal-tls-server-name` (every daemon).
pub const INTERNAL_TLS_SERVER_NAME: &str = "FERRY_INTERNAL_TLS_SERVER_NAME";

/// `--in-queue-threshold` (ferry prefill).
pub const IN_QUEUE_THRESHOLD: &str = "FERRY_IN_QUEUE_THRESHOLD";

/// `--kv-host-mirror` (ferry prefill, ferry decode).
pub const KV_HOST_MIRROR: &str = "FERRY_KV_HOST_MIRROR";

/// `--load-poll` (ferry router).
pub const LOAD_POLL: &str = "FERRY_LOAD_POLL";
/// `--load-polls-per-second` (ferry router).
pub const LOAD_POLLS_PER_SECOND: &str = "FERRY_LOAD_POLLS_PER_SECOND";

/// `--local-prefill-below` (ferry router).
pub const LOCAL_PREFILL_BELOW: &str = "FERRY_LOCAL_PREFILL_BELOW";
/// `--local-prefill-max` (ferry router).
pub const LOCAL_PREFILL_MAX: &str = "FERRY_LOCAL_PREFILL_MAX";

/// `--max-dest-pages` (ferry prefill).
pub const MAX_DEST_PAGES: &str = "FERRY_MAX_DEST_PAGES";

/// `--max-index-pages` (ferry router).
pub const MAX_INDEX_PAGES: &str = "FERRY_MAX_INDEX_PAGES";

/// `--max-queued-requests` (ferry router).
pub const MAX_QUEUED_REQUESTS: &str = "FERRY_MAX_QUEUED_REQUESTS";

/// `--migration-limit` (ferry router).
pub const MIGRATION_LIMIT: &str = "FERRY_MIGRATION_LIMIT";

/// `--max-stop-strings` (ferry router).
pub const MAX_STOP_STRINGS: &str = "FERRY_MAX_STOP_STRINGS";

/// `--max-stop-string-bytes` (ferry router).
pub const MAX_STOP_STRING_BYTES: &str = "FERRY_MAX_STOP_STRING_BYTES";

/// `--mem-fraction` (ferry prefill, ferry decode).
pub const MEM_FRACTION: &str = "FERRY_MEM_FRACTION";

/// `--metrics-addr` (ferry prefill, ferry decode; ferry router).
pub const METRICS_ADDR: &str = "FERRY_METRICS_ADDR";

/// `--min-new-token-ratio` (ferry decode).
pub const MIN_NEW_TOKEN_RATIO: &str = "FERRY_MIN_NEW_TOKEN_RATIO";

/// `--model` (ferry generate; ferry prefill, ferry decode; ferry router; ferry up).
pub const MODEL: &str = "FERRY_MODEL";

/// `--new-token-ratio-decay-steps` (ferry decode).
pub const NEW_TOKEN_RATIO_DECAY_STEPS: &str = "FERRY_NEW_TOKEN_RATIO_DECAY_STEPS";

/// `--num-reserved-decode-tokens` (ferry decode).
pub const NUM_RESERVED_DECODE_TOKENS: &str = "FERRY_NUM_RESERVED_DECODE_TOKENS";

/// `--otlp-endpoint` (every daemon).
pub const OTLP_ENDPOINT: &str = "FERRY_OTLP_ENDPOINT";

/// `--page-size` (ferry prefill, ferry decode; ferry router).
pub const PAGE_SIZE: &str = "FERRY_PAGE_SIZE";

/// `--policy` (ferry router).
pub const POLICY: &str = "FERRY_POLICY";

/// `--pool-pages` (ferry prefill, ferry decode).
pub const POOL_PAGES: &str = "FERRY_POOL_PAGES";

/// `--prealloc-timeout` (ferry decode).
pub const PREALLOC_TIMEOUT: &str = "FERRY_PREALLOC_TIMEOUT";

/// `--prefill` (ferry router).
pub const PREFILL: &str = "FERRY_PREFILL";

/// `--python` (ferry model fetch; ferry up).
pub const PYTHON: &str = "FERRY_PYTHON";

/// `--queue-timeout` (ferry router).
pub const QUEUE_TIMEOUT: &str = "FERRY_QUEUE_TIMEOUT";

/// `--max-running-requests` (ferry router).
pub const ROUTER_MAX_RUNNING_REQUESTS: &str = "FERRY_ROUTER_MAX_RUNNING_REQUESTS";

/// `--schedule-policy` (ferry prefill).
pub const SCHEDULE_POLICY: &str = "FERRY_SCHEDULE_POLICY";

/// `--served-model-name` (ferry router).
pub const SERVED_MODEL_NAME: &str = "FERRY_SERVED_MODEL_NAME";

/// `--tls-cert` (ferry router).
pub const TLS_CERT: &str = "FERRY_TLS_CERT";

/// `--tls-key` (ferry router).
pub const TLS_KEY: &str = "FERRY_TLS_KEY";

/// `--tokenizer-cache-mib` (ferry router).
pub const TOKENIZER_CACHE_MIB: &str = "FERRY_TOKENIZER_CACHE_MIB";

/// `--transfer` (ferry prefill, ferry decode).
pub const TRANSFER: &str = "FERRY_TRANSFER";

/// `--transfer-addr` (ferry prefill, ferry decode).
pub const TRANSFER_ADDR: &str = "FERRY_TRANSFER_ADDR";

/// `--transfer-advertise-addr` (ferry prefill, ferry decode).
pub const TRANSFER_ADVERTISE_ADDR: &str = "FERRY_TRANSFER_ADVERTISE_ADDR";

/// `--transfer-connections` (ferry prefill, ferry decode).
pub const TRANSFER_CONNECTIONS: &str = "FERRY_TRANSFER_CONNECTIONS";

/// `--transfer-timeout` (ferry prefill, ferry decode).
pub const TRANSFER_TIMEOUT: &str = "FERRY_TRANSFER_TIMEOUT";

/// `--waiting-timeout` (ferry prefill, ferry decode).
pub const WAITING_TIMEOUT: &str = "FERRY_WAITING_TIMEOUT";

/// `--workers-file` (ferry router).
pub const WORKERS_FILE: &str = "FERRY_WORKERS_FILE";

/// `--worker-id` (ferry prefill, ferry decode).
pub const WORKER_ID: &str = "FERRY_WORKER_ID";

/// Every name above.
pub const ALL: &[&str] = &[
    ADVERTISE_ADDR,
    API_KEY,
    API_KEYS,
    BOOTSTRAP_TIMEOUT,
    CACHE_DIR,
    CHUNKED_PREFILL_SIZE,
    CLUSTER,
    CPU_MATH,
    DECODE,
    DECODE_ADMISSION,
    DECODE_MAX_RUNNING_REQUESTS,
    DECODE_REQUEST_TOKENS,
    DISABLE_JUMP_FORWARD,
    DRAIN_GRACE,
    DISABLE_DECODE_CACHE,
    DISABLE_PULL,
    DEVICE,
    DTYPE,
    ETCD,
    ETCD_CA,
    ETCD_CERT,
    ETCD_KEY,
    ETCD_LEASE_TTL,
    ETCD_PASSWORD_FILE,
    ETCD_USER,
    GRPC_ADDR,
    HTTP_ADDR,
    INIT_NEW_TOKEN_RATIO,
    INSECURE_INTERNAL,
    INTERNAL_TLS_CA,
    INTERNAL_TLS_CERT,
    INTERNAL_TLS_KEY,
    INTERNAL_TLS_SERVER_NAME,
    IN_QUEUE_THRESHOLD,
    KV_HOST_MIRROR,
    LOAD_POLL,
    LOAD_POLLS_PER_SECOND,
    LOCAL_PREFILL_BELOW,
    LOCAL_PREFILL_MAX,
    MAX_DEST_PAGES,
    MAX_INDEX_PAGES,
    MAX_QUEUED_REQUESTS,
    MAX_STOP_STRINGS,
    MAX_STOP_STRING_BYTES,
    MEM_FRACTION,
    METRICS_ADDR,
    MIGRATION_LIMIT,
    MODEL,
    MIN_NEW_TOKEN_RATIO,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    NUM_RESERVED_DECODE_TOKENS,
    OTLP_ENDPOINT,
    PAGE_SIZE,
    POLICY,
    POOL_PAGES,
    PREALLOC_TIMEOUT,
    PREFILL,
    PYTHON,
    QUEUE_TIMEOUT,
    ROUTER_MAX_RUNNING_REQUESTS,
    SCHEDULE_POLICY,
    SERVED_MODEL_NAME,
    TLS_CERT,
    TLS_KEY,
    TOKENIZER_CACHE_MIB,
    TRANSFER,
    TRANSFER_ADDR,
    TRANSFER_ADVERTISE_ADDR,
    TRANSFER_CONNECTIONS,
    TRANSFER_TIMEOUT,
    WAITING_TIMEOUT,
    WORKERS_FILE,
    WORKER_ID,
];
