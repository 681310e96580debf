//! Admission (first come, first served, against the pages free and the estimate promised to
//! requests admitted earlier) and its safety net, retraction (see the parent module).

use std::time::Instant;

use ferry_cluster::Room;

use super::{Action, Admission, Entry, Queues, Stage};

/// After a retraction, the estimate covers this many more tokens of every running request
/// than it has generated (SGLang's `retract_decode_steps`).
const RETRACT_DECODE_STEPS: usize = 20;

/// The request to retract among `candidates` (room, decoded tokens, admission order): the one
/// with the least decoded progress, the newest among equals. Retracting it loses the least
/// work, and the oldest requests keep going, so some request always finishes.
pub fn victim(candidates: &[(Room, usize, u64)]) -> Option<Room> {
    candidates.iter().min_by_key(|&&(_, progress, order)| (progress, std::cmp::Reverse(order))).map(|c| c.0)
}

/// The adaptive ratio's fall per decode step: from `from` to `min` in `steps` equal parts.
pub(super) fn fall(from: f64, min: f64, steps: u32) -> f64 {
    (from - min).max(0.0) / f64::from(steps.max(1))
}

impl Queues {
    /// Pages set aside for admitted requests' decoding and not yet taken.
    pub fn promised(&self) -> usize {
        let admitted = self.entries.values().filter(|e| e.stage != Stage::Prealloc);
        match self.limits.admission {
            Admission::Adaptive { .. } => admitted.map(|e| e.n * self.estimate(e.context(), e.remaining())).sum(),
            Admission::Reserved { .. } => admitted.map(|e| e.reserve.saturating_sub(e.grown)).sum(),
        }
    }

    fn admitted(&self) -> usize {
        self.entries.values().filter(|e| e.stage != Stage::Prealloc).map(|e| e.n).sum()
    }

    /// Pages the admission estimate sets aside for decoding `remaining` tokens after `context`.
    fn estimate(&self, context: usize, remaining: usize) -> usize {
        let tokens = match self.limits.admission {
            Admission::Adaptive { .. } => (self.ratio * remaining as f64).ceil() as usize,
            Admission::Reserved { tokens } => tokens,
        };
        self.pages(context + tokens.min(remaining)) - self.pages(context)
    }

    /// Admits from the head of the prealloc queue while the free pages allow; the engine
    /// allocates their pages right away.
    pub(super) fn admit(&mut self, now: Instant) -> Vec<Action> {
        self.admit_within(self.free_pages(), now)
    }

    /// [`admit`](Self::admit) as if `free` pages were free.
    pub(super) fn admit_within(&mut self, mut free: usize, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        let mut promised = self.promised();
        let mut admitted = self.admitted();
        while let Some(&room) = self.prealloc.front() {
            let Some(e) = self.entries.get(&room) else {
                self.prealloc.pop_front();
                continue;
            };
            // A fork's other sequences each take a page at once: their copy of the prompt's
            // last page.
            let need = self.pages(e.context()) + e.n - 1;
            let reserve = e.n * self.estimate(e.context(), e.remaining());
            if admitted + e.n > self.limits.max_running || free < promised + need + reserve {
                break;
            }
            self.prealloc.pop_front();
            self.admissions += 1;
            let order = self.admissions;
            let Some(e) = self.entries.get_mut(&room) else { continue };
            e.stage = if e.local { Stage::Prefill } else { Stage::Transfer };
            e.since = now;
            e.reserve = reserve;
            e.grown = 0;
            e.order = order;
            e.held = need;
            self.used += need;
            free -= need;
            promised += reserve;
            admitted += e.n;
            out.push(Action::Allocate { room, pages: need, local: e.local });
        }
        out
    }

    /// Whether a request whose prompt and generation need `pages` pages could ever be
    /// admitted with `total`.
    pub fn could_fit(total: usize, pages: usize) -> bool {
        pages <= total
    }

    /// Gives every running request the pages its next token needs. When the pool has too few
    /// free pages, retracts victims ([`victim`]; requests prefilling here count as no
    /// progress) until it has enough.
    pub(super) fn make_room(&mut self, now: Instant) -> Vec<Action> {
        let mut out = Vec::new();
        self.retracted = false;
        loop {
            let short: usize = self
                .entries
                .values()
                .filter(|e| e.stage == Stage::Running)
                .map(|e| self.pages(e.prompt + e.generated).saturating_sub(e.shared + e.held))
                .sum();
            if short <= self.free_pages() {
                break;
            }
            let candidates: Vec<(Room, usize, u64)> = self
                .entries
                .iter()
                .filter(|(_, e)| matches!(e.stage, Stage::Running | Stage::Prefill))
                .map(|(&r, e)| (r, e.generated, e.order))
                .collect();
            let Some(v) = victim(&candidates) else { break };
            out.extend(self.retract(v, now));
            self.retracted = true;
        }
        for room in self.in_stage(Stage::Running) {
            let Some(e) = self.entries.get_mut(&room) else { continue };
            let more =
                (e.prompt + e.generated).div_ceil(self.limits.page_size.max(1)).saturating_sub(e.shared + e.held);
            if more > 0 && more <= self.pool - self.used {
                e.held += more;
                e.grown += more;
                self.used += more;
                out.push(Action::Grow { room, pages: more });
            }
        }
        out
    }

    /// `room` (admitted) is retracted: its pages go back (with its group's when it was their
    /// last reader: a forked sequence recomputes its whole context alone); it waits at the
    /// front of the prealloc queue and prefills its context here when admitted again. The
    /// adaptive estimate becomes what the requests still admitted have shown (see the module).
    pub(super) fn retract(&mut self, room: Room, now: Instant) -> Option<Action> {
        if self.entries.get(&room)?.stage == Stage::Prealloc {
            return None;
        }
        let group = self.leave(room);
        let e = self.entries.get_mut(&room)?;
        let (pages, running) = (e.held + group, e.stage == Stage::Running);
        *e = Entry { stage: Stage::Prealloc, since: now, local: true, held: 0, reserve: 0, grown: 0, ..*e };
        let context = e.context();
        self.used -= pages - group;
        self.prealloc.push_front(room);
        if let Admission::Adaptive { min, steps, .. } = self.limits.admission {
            let admitted = self.entries.values().filter(|e| e.stage != Stage::Prealloc);
            let (n, generated, limit) =
                admitted.fold((0, 0, 0), |(n, g, l), e| (n + e.n, g + e.generated, l + e.n * e.limit.max(1)));
            let shown = (generated + RETRACT_DECODE_STEPS * n) as f64 / limit.max(1) as f64;
            self.ratio = shown.clamp(min, 1.0);
            self.fall = fall(self.ratio, min, steps);
        }
        Some(Action::Retract { room, pages, context, running })
    }

    /// One decode step ran without a retraction: the adaptive estimate decays.
    pub(super) fn decoded(&mut self) {
        if let Admission::Adaptive { min, .. } = self.limits.admission {
            self.ratio = (self.ratio - self.fall).max(min);
        }
    }

    /// The adaptive estimate's ratio (1 with a fixed reservation).
    pub fn ratio(&self) -> f64 {
        self.ratio
    }
}
