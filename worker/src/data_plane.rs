//! The KV data plane under the daemons' mutual TLS: the identities of `--internal-tls-*`,
//! each side serving or calling only the role it must.

use std::sync::Arc;

use ferry_cluster::mtls::InternalTls;
use ferry_cluster::roles::{PeerRole, expect_role};
use ferry_transfer::secure::{DataTls, PeerCheck, PeerRefused, Security};

/// Pages prefill → decode: a decode node's receiver serves only prefill nodes, a prefill node
/// sends only to decode nodes (`--internal-tls-server-name`, when set, is the name checked as
/// for gRPC).
pub fn data_plane(tls: &InternalTls) -> Security {
    let (prefill, decode) = checks();
    let server_name = tls.server_name().map(String::from);
    Security::Tls(Arc::new(DataTls::new(tls.server_config(), &tls.client_config(), server_name, prefill, decode)))
}

/// Pages decode → prefill, for pulls (issue 20): a prefill node's pull receiver serves only
/// decode nodes, a decode node sends held pages only to prefill nodes.
pub fn pull_plane(tls: &InternalTls) -> Security {
    let (prefill, decode) = checks();
    let server_name = tls.server_name().map(String::from);
    Security::Tls(Arc::new(DataTls::new(tls.server_config(), &tls.client_config(), server_name, decode, prefill)))
}

/// The checks that a peer is a prefill node, and a decode node.
fn checks() -> (PeerCheck, PeerCheck) {
    let refused = |e: ferry_cluster::roles::RoleError| PeerRefused(e.to_string());
    let prefill: PeerCheck = Arc::new(move |chain| expect_role(chain, PeerRole::Prefill).map_err(refused));
    let decode: PeerCheck = Arc::new(move |chain| expect_role(chain, PeerRole::Decode).map_err(refused));
    (prefill, decode)
}
