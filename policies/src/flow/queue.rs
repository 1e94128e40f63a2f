//! [`Flow`]: where requests wait before routing, one band per class, one queue per tenant
//! within a band. Generic over the driver's payload (the simulator's `()`, the live
//! fleet's reply stream), which waits with its request.

use super::programs::Programs;
use super::usage::Usage;
use super::{retry_after, Fairness, FlowConfig, FlowRule, Shed, ShedReason, Targets};
use crate::router::CostHints;
use crate::view::FleetView;
use engine::{Request, TenantId, Time};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, VecDeque};

/// What became of a request offered to flow control.
#[derive(Debug)]
pub enum Offer<P> {
    /// Room now and nobody ahead: place it.
    Place(Request, P),
    /// It waits for room; [`Flow::next`] gives it back.
    Queued,
    Shed(Shed<P>),
}

/// Requests waiting for room, in bands of priority.
#[derive(Debug)]
pub struct Flow<P> {
    rule: Option<Box<dyn FlowRule>>,
    entries: Vec<Option<Entry<P>>>,
    free: Vec<u32>,
    next_seq: u64,
    bands: [Band; 3],
    /// When queued sheddable requests are shed (entries that left since are skipped).
    shed_times: BinaryHeap<Reverse<(Time, u64, u32)>>,
    /// One instance's prefill rate, for retry-after.
    prefill_tokens_per_s: f64,
    /// The programs in progress, with admission by program.
    programs: Option<Programs>,
    /// Tenants' recent service, with least attained service.
    usage: Option<Usage>,
}

/// Later turns of programs in progress go ahead of every first turn in their band.
const CONTINUING_FIRST: i64 = 1 << 60;

#[derive(Debug)]
struct Entry<P> {
    seq: u64,
    request: Request,
    payload: P,
}

#[derive(Debug, Default)]
struct Band {
    /// Tenants with requests waiting (a tenant whose queue empties leaves).
    tenants: BTreeMap<TenantId, TenantQueue>,
    len: usize,
    /// Prompt tokens waiting.
    tokens: u64,
    /// The tenant served last (round robin).
    last: Option<TenantId>,
}

#[derive(Debug, Default)]
struct TenantQueue {
    /// (order, seq, slot) of its requests still on time.
    on_time: BinaryHeap<Reverse<(i64, u64, u32)>>,
    /// Those found late at the head, in the order found.
    late: VecDeque<(u64, u32)>,
    len: usize,
}

impl<P> Flow<P> {
    pub fn new(config: &FlowConfig, hints: &CostHints, targets: [Targets; 3]) -> Flow<P> {
        let rule = config.build(hints, targets);
        let usage = match rule.as_ref().map(|r| r.fairness()) {
            Some(Fairness::LeastAttained { half_life, output_weight }) => Some(Usage::new(half_life, output_weight)),
            _ => None,
        };
        Flow {
            usage,
            programs: rule
                .as_ref()
                .and_then(|r| r.program_admission())
                .map(|(share, idle, packing)| Programs::new(share, idle, packing)),
            rule,
            entries: Vec::new(),
            free: Vec::new(),
            next_seq: 0,
            bands: Default::default(),
            shed_times: BinaryHeap::new(),
            prefill_tokens_per_s: hints.prefill_tokens_per_s,
        }
    }

    /// Whether any flow control is on (`none` places every request at once).
    pub fn is_on(&self) -> bool {
        self.rule.is_some()
    }

    pub fn rule_name(&self) -> &'static str {
        self.rule.as_ref().map_or("none", |r| r.name())
    }

    /// Requests waiting, by [`Class::index`].
    pub fn queued(&self) -> [usize; 3] {
        [self.bands[0].len, self.bands[1].len, self.bands[2].len]
    }

    pub fn len(&self) -> usize {
        self.bands.iter().map(|b| b.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An arriving request: placed at once when its band and every higher one are empty and
    /// the fleet has room; else queued, or shed.
    pub fn offer(&mut self, now: Time, request: Request, payload: P, view: &FleetView) -> Offer<P> {
        let Some(rule) = &self.rule else {
            return Offer::Place(request, payload);
        };
        let class = request.service.class;
        let b = class.index();
        // A later turn of a program in progress goes ahead of its band's queue (see `order`),
        // and so does the request of a tenant that would be served before every tenant waiting.
        let continues = self.programs.as_ref().is_some_and(|p| p.continues(&request));
        let ahead = self.bands[..b].iter().any(|band| band.len > 0)
            || (self.bands[b].len > 0 && !continues && !self.goes_first(now, b, request.service.tenant));
        let room = !ahead && rule.has_room(view, &request, self.over_share(now, &request));
        if room && self.program_room(view, &request) {
            let request = self.placed(now, request, view);
            return Offer::Place(request, payload);
        }
        if room && continues {
            // Its program outgrew the share and is the shortest (packing): it pauses.
            if let (Some(p), Some(session)) = (&mut self.programs, request.service.session) {
                p.pause(session);
            }
        }
        let reason = if class.sheddable() && rule.shed_when_full() {
            Some(ShedReason::Saturated { class })
        } else if self.bands[b].len >= rule.queue_limit() {
            Some(ShedReason::QueueFull { class, limit: rule.queue_limit() })
        } else {
            None
        };
        if let Some(reason) = reason {
            let retry_after = self.retry_after(b, view);
            return Offer::Shed(Shed { request, payload, reason, retry_after });
        }
        let order = rule.order(&request).saturating_sub(if continues { CONTINUING_FIRST } else { 0 });
        let shed_at = rule.shed_at(&request);
        let seq = self.next_seq;
        self.next_seq += 1;
        let tenant = request.service.tenant;
        let prompt = u64::from(request.prompt_tokens);
        let slot = engine::slots::place(&mut self.entries, &mut self.free, Some(Entry { seq, request, payload }));
        let band = &mut self.bands[b];
        let queue = band.tenants.entry(tenant).or_default();
        queue.on_time.push(Reverse((order, seq, slot)));
        queue.len += 1;
        band.len += 1;
        band.tokens += prompt;
        if let Some(t) = shed_at {
            self.shed_times.push(Reverse((t.max(now), seq, slot)));
        }
        Offer::Queued
    }

    /// The next request to place, if the fleet has room for it: the highest band with
    /// requests waiting, its tenant by the rule's fairness, that tenant's first request. A
    /// tenant whose first request is a program's first turn waiting for programs in progress
    /// to end (admission by program) lets the next tenant go: the room it waits for is not
    /// the fleet's.
    pub fn next(&mut self, now: Time, view: &FleetView) -> Option<(Request, P)> {
        let fairness = self.rule.as_ref()?.fairness();
        let b = self.bands.iter().position(|band| band.len > 0)?;
        // When every head waits for programs: the oldest arrival among them.
        let mut waiting_since: Option<Time> = None;
        for tenant in self.tenant_order(b, fairness, now) {
            let Some(slot) = self.head(b, tenant, now) else { continue };
            let entry = self.entries[slot as usize].as_ref().expect("the head is queued");
            let over_share = self.over_share(now, &entry.request);
            if !self.rule.as_ref()?.has_room(view, &entry.request, over_share) {
                return None;
            }
            if !self.program_room(view, &entry.request) {
                let arrival = entry.request.arrival;
                waiting_since = Some(waiting_since.map_or(arrival, |t| t.min(arrival)));
                continue;
            }
            return Some(self.take(now, b, slot, view));
        }
        let programs = self.programs.as_ref().filter(|p| p.packing())?;
        if waiting_since.is_some_and(|t| now.since(t) > programs.idle()) {
            return None;
        }
        let slot = self.best_fit(now, b, view)?;
        Some(self.take(now, b, slot, view))
    }

    /// Takes queued `slot` of band `b` out to be placed.
    fn take(&mut self, now: Time, b: usize, slot: u32, view: &FleetView) -> (Request, P) {
        let entry = self.remove(slot);
        self.bands[b].last = Some(entry.request.service.tenant);
        let request = self.placed(now, entry.request, view);
        (request, entry.payload)
    }

    /// The queued program turn of band `b` with the largest context that fits the room left
    /// for programs and has room in the fleet (the oldest of equals): best-fit-decreasing.
    fn best_fit(&self, now: Time, b: usize, view: &FleetView) -> Option<u32> {
        let rule = self.rule.as_ref()?;
        let mut best: Option<(u64, Reverse<u64>, u32)> = None;
        for (slot, entry) in self.entries.iter().enumerate() {
            let Some(e) = entry else { continue };
            let r = &e.request;
            if r.service.session.is_none() || r.service.class.index() != b {
                continue;
            }
            let key = (super::programs::context(r), Reverse(e.seq), slot as u32);
            if best.is_some_and(|b| b >= key) {
                continue;
            }
            if self.program_room(view, r) && rule.has_room(view, r, self.over_share(now, r)) {
                best = Some(key);
            }
        }
        best.map(|(_, _, slot)| slot)
    }

    /// Sheds every queued request whose time to be shed has come.
    pub fn expire(&mut self, now: Time, view: &FleetView, out: &mut Vec<Shed<P>>) {
        if let Some(p) = &mut self.programs {
            p.expire(now);
        }
        while let Some(&Reverse((t, seq, slot))) = self.shed_times.peek() {
            if t > now {
                break;
            }
            self.shed_times.pop();
            if !self.holds(seq, slot) {
                continue;
            }
            let entry = self.remove(slot);
            let class = entry.request.service.class;
            let waited_ms = now.since(entry.request.arrival).0 / 1000;
            let retry_after = self.retry_after(class.index(), view);
            let reason = ShedReason::Waited { class, waited_ms };
            out.push(Shed { request: entry.request, payload: entry.payload, reason, retry_after });
        }
    }

    /// When [`Flow::expire`] has something to do next, if ever (possibly earlier: a request
    /// that left may still be counted).
    pub fn next_deadline(&self) -> Option<Time> {
        let shed = self.shed_times.peek().map(|Reverse((t, ..))| *t);
        // A program going idle may let a queued first turn in (nothing to do with none queued).
        let idle = self.programs.as_ref().and_then(Programs::next_expiry).filter(|_| !self.is_empty());
        [shed, idle].into_iter().flatten().min()
    }

    /// Whether admission by program lets `request` start now.
    fn program_room(&self, view: &FleetView, request: &Request) -> bool {
        let Some(p) = &self.programs else { return true };
        p.admits(request, Self::program_kv(view, request))
    }

    /// The GPU KV programs share: the candidates' for `request`.
    fn program_kv(view: &FleetView, request: &Request) -> u64 {
        view.candidates(request).map(|v| v.capacity_tokens).sum()
    }

    /// Programs paused so far (admission by program with packing).
    pub fn programs_paused(&self) -> u64 {
        self.programs.as_ref().map_or(0, Programs::paused)
    }

    /// Counts a request placed; lifts it when its tenant is under its share (see
    /// [`engine::Service::lift`]).
    fn placed(&mut self, now: Time, mut request: Request, view: &FleetView) -> Request {
        if let Some(p) = &mut self.programs {
            p.placed(now, &request, Self::program_kv(view, &request));
        }
        if let Some(u) = &mut self.usage {
            request.service.lift = u.under_share(now, request.service.tenant);
            u.add_request(now, &request);
        }
        request
    }

    /// Whether the request's tenant had more than an equal share of the recent service
    /// (with least attained service; see [`Usage::over_share`]).
    fn over_share(&self, now: Time, request: &Request) -> bool {
        self.usage.as_ref().is_some_and(|u| u.over_share(now, request.service.tenant))
    }

    /// Whether a request of `tenant`, which has none waiting in band `b`, would be served
    /// before every tenant waiting there (least attained service: it has had less).
    fn goes_first(&self, now: Time, b: usize, tenant: TenantId) -> bool {
        let Some(u) = &self.usage else { return false };
        let band = &self.bands[b];
        !band.tenants.contains_key(&tenant) && band.tenants.keys().all(|&t| u.of(now, tenant) < u.of(now, t))
    }

    /// Takes out every queued request whose payload `gone` says is no longer wanted (its
    /// client went away), in no particular order.
    pub fn remove_where(&mut self, mut gone: impl FnMut(&P) -> bool) -> Vec<(Request, P)> {
        let slots: Vec<u32> = (0..self.entries.len() as u32)
            .filter(|&s| self.entries[s as usize].as_ref().is_some_and(|e| gone(&e.payload)))
            .collect();
        slots
            .into_iter()
            .map(|s| {
                let e = self.remove(s);
                (e.request, e.payload)
            })
            .collect()
    }

    fn holds(&self, seq: u64, slot: u32) -> bool {
        self.entries.get(slot as usize).and_then(Option::as_ref).is_some_and(|e| e.seq == seq)
    }

    /// The tenants waiting in band `b`, in the order the rule's fairness serves them: least
    /// attained service first (ties by id), or round robin from the one after the last served.
    fn tenant_order(&self, b: usize, fairness: Fairness, now: Time) -> Vec<TenantId> {
        let band = &self.bands[b];
        let mut order: Vec<TenantId> = band.tenants.keys().copied().collect();
        match (fairness, &self.usage) {
            // Stable: equal service keeps id order.
            (Fairness::LeastAttained { .. }, Some(u)) => order.sort_by(|&a, &b| u.of(now, a).total_cmp(&u.of(now, b))),
            _ => {
                let after = band.last.map_or(0, |last| order.partition_point(|&t| t <= last));
                order.rotate_left(after);
            }
        }
        order
    }

    /// The slot of `tenant`'s first request in band `b`: its first on-time one (moving those
    /// found late behind), else its first late one.
    fn head(&mut self, b: usize, tenant: TenantId, now: Time) -> Option<u32> {
        let rule = self.rule.as_ref()?;
        let queue = self.bands[b].tenants.get_mut(&tenant)?;
        while let Some(&Reverse((_, seq, slot))) = queue.on_time.peek() {
            let entry = match self.entries.get(slot as usize).and_then(Option::as_ref) {
                Some(e) if e.seq == seq => e,
                _ => {
                    queue.on_time.pop();
                    continue;
                }
            };
            if rule.late_at(&entry.request).is_some_and(|t| t < now) {
                queue.on_time.pop();
                queue.late.push_back((seq, slot));
                continue;
            }
            return Some(slot);
        }
        while let Some(&(seq, slot)) = queue.late.front() {
            if self.entries.get(slot as usize).and_then(Option::as_ref).is_some_and(|e| e.seq == seq) {
                return Some(slot);
            }
            queue.late.pop_front();
        }
        None
    }

    /// Takes a queued request out of the queues' counts (its heap entries become stale).
    fn remove(&mut self, slot: u32) -> Entry<P> {
        let entry = self.entries[slot as usize].take().expect("a queued slot");
        self.free.push(slot);
        let band = &mut self.bands[entry.request.service.class.index()];
        band.len -= 1;
        band.tokens -= u64::from(entry.request.prompt_tokens);
        let tenant = entry.request.service.tenant;
        if let Some(q) = band.tenants.get_mut(&tenant) {
            q.len -= 1;
            if q.len == 0 {
                band.tenants.remove(&tenant);
            }
        }
        entry
    }

    fn retry_after(&self, b: usize, view: &FleetView) -> engine::Dur {
        let ahead: u64 = self.bands[..=b].iter().map(|band| band.tokens).sum();
        let rate = view.serving_count() as f64 * self.prefill_tokens_per_s;
        retry_after(ahead, rate)
    }
}
