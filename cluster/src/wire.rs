//! The one place where generated `ferry.v1` types meet Ferry's domain types.
//!
//! Incoming messages are validated here (`TryFrom`), so every handler works with values that
//! are known to be well-formed; outgoing ones are built with `From`.

use ferry_proto::v1 as pb;
use ferry_tokenize::{Constraint, FinishReason, SamplingParams};

use crate::{LayoutDescriptor, Room, RoomKey, RoomSecret};

/// A message field that is missing or malformed; maps to gRPC `INVALID_ARGUMENT`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid field {field}: {problem}")]
pub struct WireError {
    /// The field, dotted from the message root.
    pub field: &'static str,
    /// What is wrong.
    pub problem: String,
}

fn bad(field: &'static str, problem: impl Into<String>) -> WireError {
    WireError { field, problem: problem.into() }
}

/// Unset or zero numeric fields in a proto message mean "the default".
fn or_default(v: f32, d: f32) -> f32 {
    if v == 0.0 { d } else { v }
}

/// Converts wire sampling parameters (proto3 zero = default) into domain ones. Ranges are
/// checked by [`SamplingParams::validate`], against the model's vocabulary.
pub fn sampling_from_proto(p: Option<pb::SamplingParams>) -> SamplingParams {
    let d = SamplingParams::default();
    let Some(p) = p else { return d };
    SamplingParams {
        temperature: p.temperature,
        top_k: p.top_k,
        top_p: or_default(p.top_p, d.top_p),
        min_p: p.min_p,
        repetition_penalty: or_default(p.repetition_penalty, d.repetition_penalty),
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        seed: p.seed,
        max_new_tokens: if p.max_new_tokens == 0 { d.max_new_tokens } else { p.max_new_tokens },
        stop_token_ids: p.stop_token_ids,
        top_logprobs: p.top_logprobs,
        ignore_eos: p.ignore_eos,
        constraint: p.constraint.and_then(|c| c.kind).and_then(constraint_from_proto),
        prompt_logprobs: p.prompt_logprobs,
        n: p.n.max(1),
        logit_bias: {
            let mut b: Vec<(u32, f32)> = p.logit_bias.into_iter().collect();
            b.sort_unstable_by_key(|&(id, _)| id);
            b
        },
        resumed: p.resumed,
    }
}

/// `json_object: false` asks for nothing.
fn constraint_from_proto(k: pb::output_constraint::Kind) -> Option<Constraint> {
    use pb::output_constraint::Kind;
    Some(match k {
        Kind::JsonObject(false) => return None,
        Kind::JsonObject(true) => Constraint::JsonObject,
        Kind::JsonSchema(s) => Constraint::JsonSchema(s),
        Kind::Regex(r) => Constraint::Regex(r),
        Kind::Choice(c) => Constraint::Choice(c.options),
    })
}

/// A constraint on the wire.
pub fn constraint_to_proto(c: &Constraint) -> pb::OutputConstraint {
    use pb::output_constraint::Kind;
    let kind = match c {
        Constraint::JsonObject => Kind::JsonObject(true),
        Constraint::JsonSchema(s) => Kind::JsonSchema(s.clone()),
        Constraint::Regex(r) => Kind::Regex(r.clone()),
        Constraint::Choice(o) => Kind::Choice(pb::ChoiceList { options: o.clone() }),
    };
    pb::OutputConstraint { kind: Some(kind) }
}

/// Domain sampling parameters on the wire.
pub fn sampling_to_proto(s: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        repetition_penalty: s.repetition_penalty,
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        seed: s.seed,
        max_new_tokens: s.max_new_tokens,
        stop_token_ids: s.stop_token_ids.clone(),
        top_logprobs: s.top_logprobs,
        ignore_eos: s.ignore_eos,
        constraint: s.constraint.as_ref().map(constraint_to_proto),
        prompt_logprobs: s.prompt_logprobs,
        n: s.n,
        logit_bias: s.logit_bias.iter().copied().collect(),
        resumed: s.resumed,
    }
}

/// A finish reason on the wire.
pub fn finish_to_proto(f: FinishReason) -> pb::FinishReason {
    match f {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
        FinishReason::Abort => pb::FinishReason::Abort,
    }
}

/// A finish reason from the wire; `None` for "not finished yet" (unspecified) and errors.
pub fn finish_from_proto(f: pb::FinishReason) -> Option<FinishReason> {
    match f {
        pb::FinishReason::Stop => Some(FinishReason::Stop),
        pb::FinishReason::Length => Some(FinishReason::Length),
        pb::FinishReason::Abort => Some(FinishReason::Abort),
        pb::FinishReason::Unspecified | pb::FinishReason::Error => None,
    }
}

/// A room key from the wire, validated. (Functions, not `TryFrom`: the domain types live in
/// `ferry-core` and the generated ones in `ferry-proto`.)
pub fn room_key(k: Option<pb::RoomKey>) -> Result<RoomKey, WireError> {
    {
        let k = k.ok_or_else(|| bad("room", "missing"))?;
        let room = Room::new(k.room).ok_or_else(|| bad("room.room", "room ids have 63 bits"))?;
        let secret: [u8; 16] = k
            .secret
            .as_slice()
            .try_into()
            .map_err(|_| bad("room.secret", format!("{} bytes, expected 16", k.secret.len())))?;
        Ok(RoomKey { room, secret: RoomSecret::from_bytes(secret) })
    }
}

/// [`room_key`] back.
pub fn room_key_to_proto(k: &RoomKey) -> pb::RoomKey {
    pb::RoomKey { room: k.room.get(), secret: k.secret.as_bytes().to_vec() }
}

/// A KV layout from the wire, validated.
pub fn layout(l: Option<pb::LayoutDescriptor>) -> Result<LayoutDescriptor, WireError> {
    {
        let l = l.ok_or_else(|| bad("layout", "missing"))?;
        if l.model_fingerprint.is_empty() {
            return Err(bad("layout.model_fingerprint", "empty"));
        }
        for (name, v) in [
            ("layout.num_layers", l.num_layers),
            ("layout.num_kv_heads", l.num_kv_heads),
            ("layout.head_dim", l.head_dim),
            ("layout.page_size", l.page_size),
        ] {
            if v == 0 {
                return Err(bad(name, "must be positive"));
            }
        }
        Ok(LayoutDescriptor {
            model_fingerprint: l.model_fingerprint,
            dtype: l.dtype,
            num_layers: l.num_layers,
            num_kv_heads: l.num_kv_heads,
            head_dim: l.head_dim,
            page_size: l.page_size,
        })
    }
}

/// [`layout`] back.
pub fn layout_to_proto(l: &LayoutDescriptor) -> pb::LayoutDescriptor {
    pb::LayoutDescriptor {
        model_fingerprint: l.model_fingerprint.clone(),
        dtype: l.dtype.clone(),
        num_layers: l.num_layers,
        num_kv_heads: l.num_kv_heads,
        head_dim: l.head_dim,
        page_size: l.page_size,
    }
}

/// One position's most likely tokens `(id, logprob)`, best first, on the wire.
pub fn top_to_proto(top: &[(u32, f32)]) -> pb::TopLogprobs {
    pb::TopLogprobs {
        candidates: top.iter().map(|&(token_id, logprob)| pb::TokenLogprob { token_id, logprob }).collect(),
    }
}

/// A request's phases on the wire.
pub fn phases_to_proto<S: AsRef<str>>(laps: &[(S, f64)]) -> Vec<pb::PhaseTime> {
    laps.iter().map(|(p, s)| pb::PhaseTime { phase: p.as_ref().to_string(), seconds: *s }).collect()
}

/// [`phases_to_proto`] back.
pub fn phases_from_proto(p: &[pb::PhaseTime]) -> Vec<(String, f64)> {
    p.iter().map(|t| (t.phase.clone(), t.seconds)).collect()
}

/// [`top_to_proto`] back.
pub fn top_from_proto(t: &pb::TopLogprobs) -> Vec<(u32, f32)> {
    t.candidates.iter().map(|c| (c.token_id, c.logprob)).collect()
}

/// One generated token (with its logprob, top alternatives and, on the last, the finish
/// reason) as a decode stream message.
pub fn token_to_proto(
    token: u32,
    logprob: f32,
    top: &[(u32, f32)],
    finish: Option<FinishReason>,
) -> pb::DecodeResponse {
    pb::DecodeResponse {
        token_ids: vec![token],
        logprobs: vec![pb::TokenLogprob { token_id: token, logprob }],
        top_logprobs: if top.is_empty() { Vec::new() } else { vec![top_to_proto(top)] },
        finish_reason: finish.map_or(pb::FinishReason::Unspecified, finish_to_proto) as i32,
        cached_tokens: 0,
        phases: Vec::new(),
        prompt_logprobs: Vec::new(),
        prompt_top_logprobs: Vec::new(),
        index: 0,
    }
}

/// One prompt position's logprob: the token, its logprob, its alternatives.
pub type PromptLogprob = (u32, f32, Vec<(u32, f32)>);

/// Prompt logprobs on the wire: the tokens with their logprobs, and (when any were asked
/// for) each one's alternatives.
pub fn prompt_to_proto(p: &[PromptLogprob]) -> (Vec<pb::TokenLogprob>, Vec<pb::TopLogprobs>) {
    let lp = p.iter().map(|&(token_id, logprob, _)| pb::TokenLogprob { token_id, logprob }).collect();
    let top =
        if p.iter().any(|x| !x.2.is_empty()) { p.iter().map(|x| top_to_proto(&x.2)).collect() } else { Vec::new() };
    (lp, top)
}

/// [`prompt_to_proto`] back.
pub fn prompt_from_proto(lp: &[pb::TokenLogprob], top: &[pb::TopLogprobs]) -> Vec<PromptLogprob> {
    lp.iter()
        .enumerate()
        .map(|(i, t)| {
            let alts =
                top.get(i).map(|c| c.candidates.iter().map(|x| (x.token_id, x.logprob)).collect()).unwrap_or_default();
            (t.token_id, t.logprob, alts)
        })
        .collect()
}

/// A worker's KV cache events on the wire.
pub fn kv_events_to_proto(
    worker: &crate::WorkerId,
    epoch: u64,
    events: &[ferry_radix::events::KvEvent],
) -> pb::KvEventBatch {
    use ferry_radix::events::{EventKind, Stored};
    let stored = |s: &Stored| pb::KvStored {
        parent_hash: s.parent_hash,
        page_hashes: s.page_hashes.clone(),
        token_ids: s.token_ids.clone(),
    };
    let events = events
        .iter()
        .map(|e| pb::KvEvent {
            sequence: e.sequence,
            kind: Some(match &e.kind {
                EventKind::Stored(s) => pb::kv_event::Kind::Stored(stored(s)),
                EventKind::Removed { page_hashes } => {
                    pb::kv_event::Kind::Removed(pb::KvRemoved { page_hashes: page_hashes.clone() })
                }
                EventKind::Snapshot(all) => {
                    pb::kv_event::Kind::Snapshot(pb::KvSnapshot { pages: all.iter().map(stored).collect() })
                }
            }),
        })
        .collect();
    pb::KvEventBatch { worker_id: worker.to_string(), epoch, events }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_round_trips_and_zero_means_default() {
        let s = SamplingParams {
            temperature: 0.7,
            top_p: 0.9,
            seed: Some(3),
            max_new_tokens: 5,
            stop_token_ids: vec![9],
            ..Default::default()
        };
        assert_eq!(sampling_from_proto(Some(sampling_to_proto(&s))), s);
        assert_eq!(sampling_from_proto(Some(pb::SamplingParams::default())), SamplingParams::default());
        assert_eq!(sampling_from_proto(None), SamplingParams::default());
    }

    #[test]
    fn room_keys_are_validated() {
        let k = RoomKey::random();
        assert_eq!(super::room_key(Some(super::room_key_to_proto(&k))), Ok(k));
        assert_eq!(super::room_key(None).map_err(|e| e.field), Err("room"));
        let short = pb::RoomKey { room: 1, secret: vec![0; 15] };
        assert_eq!(super::room_key(Some(short)).map_err(|e| e.field), Err("room.secret"));
        let big = pb::RoomKey { room: 1 << 63, secret: vec![0; 16] };
        assert_eq!(super::room_key(Some(big)).map_err(|e| e.field), Err("room.room"));
        assert!(!format!("{k:?}").contains(&format!("{:?}", k.secret.as_bytes())), "secrets are not printed");
    }

    #[test]
    fn layouts_are_validated_and_compared() {
        let l = LayoutDescriptor {
            model_fingerprint: "abc".into(),
            dtype: "f32".into(),
            num_layers: 30,
            num_kv_heads: 3,
            head_dim: 64,
            page_size: 16,
        };
        assert_eq!(super::layout(Some(super::layout_to_proto(&l))), Ok(l.clone()));
        let mut p = super::layout_to_proto(&l);
        p.page_size = 0;
        assert_eq!(super::layout(Some(p)).map_err(|e| e.field), Err("layout.page_size"));
        let other = LayoutDescriptor { page_size: 64, ..l.clone() };
        let m = l.mismatch(&other).expect("differs");
        assert!(m.contains("page_size 16 vs 64"), "{m}");
        assert_eq!(l.mismatch(&l), None);
    }

    #[test]
    fn finish_reasons_round_trip() {
        for f in [FinishReason::Stop, FinishReason::Length, FinishReason::Abort] {
            assert_eq!(finish_from_proto(finish_to_proto(f)), Some(f));
        }
    }
}
