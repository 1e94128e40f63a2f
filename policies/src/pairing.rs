//! Choosing the decode instance of a disaggregated request, when its prefill ends.
//!
//! Rule: among the serving decode instances with KV room for the prompt's KV now, prefer
//! those with room for the request's whole output too (`peak`); among those, the one where
//! the request's next token would come out first: the predicted decode step with the request
//! added ([`DecodeModel::step_us`] over the instance's batch and KV, counting what was sent
//! there since its last load report) plus the KV transfer time. Ties go to the lowest id.
//! No instance with room: the request waits on its prefill instance, KV held, until a decode
//! instance reports room.

use crate::slo_load::DecodeModel;
use crate::view::{FleetView, Role};
use engine::{Dur, InstanceId, ModelId};

/// What a KV transfer costs: `bytes_per_token × tokens / bytes_per_s + latency`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TransferHints {
    /// KV bytes of one token, over the whole instance (all layers, all GPUs).
    pub bytes_per_token: f64,
    /// Link bandwidth between a prefill and a decode instance.
    pub bytes_per_s: f64,
    /// Fixed cost of a transfer (setup, handshake).
    pub latency: Dur,
}

impl TransferHints {
    pub fn time(&self, tokens: u64) -> Dur {
        self.latency + Dur::from_secs_f64(self.bytes_per_token * tokens as f64 / self.bytes_per_s.max(1.0))
    }
}

/// KV tokens and sequences sent to an instance since its last load report.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    pub kv_tokens: u64,
    pub seqs: u32,
}

/// The decode instance chosen, and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DecodePick {
    pub instance: InstanceId,
    pub predicted_step_us: f64,
    pub transfer: Dur,
    /// Room for the whole output, not only the prompt.
    pub fits_peak: bool,
}

/// The request's KV needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvNeed {
    /// KV carried by the transfer.
    pub now_tokens: u64,
    /// KV held when the output is complete.
    pub peak_tokens: u64,
}

/// Picks the decode instance for a request whose prefill ended on an instance of `model_id`
/// (see the module doc); `reserved` is indexed by instance id (missing entries: nothing
/// reserved).
pub fn pick_decode(
    fleet: &FleetView,
    model_id: ModelId,
    reserved: &[Reserved],
    need: KvNeed,
    block_size: u32,
    model: &DecodeModel,
    transfer: &TransferHints,
) -> Option<DecodePick> {
    let block = u64::from(block_size.max(1));
    let round = |tokens: u64| tokens.div_ceil(block) * block;
    let transfer_time = transfer.time(need.now_tokens);
    let mut best: Option<(bool, f64, DecodePick)> = None;
    for v in fleet.all().iter().filter(|v| v.is_serving() && v.role == Role::Decode && v.model == model_id) {
        let r = reserved.get(v.id.0 as usize).copied().unwrap_or_default();
        let used = u64::from(v.load.kv_used_blocks) * block + r.kv_tokens;
        // The capacity from `InstanceUp`: an instance that has not stepped yet has reported
        // no load.
        let free = v.capacity_tokens.saturating_sub(used);
        if free < round(need.now_tokens) {
            continue;
        }
        let fits_peak = free >= round(need.peak_tokens);
        let seqs = f64::from(v.load.running + v.load.waiting + r.seqs + 1);
        let step = model.step_us(seqs, (used + need.now_tokens) as f64);
        let score = step + transfer_time.0 as f64;
        let pick = DecodePick { instance: v.id, predicted_step_us: step, transfer: transfer_time, fits_peak };
        let better = match &best {
            None => true,
            Some((peak, s, _)) => (fits_peak, -score) > (*peak, -*s),
        };
        if better {
            best = Some((fits_peak, score, pick));
        }
    }
    best.map(|(_, _, p)| p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::Load;

    /// Decode instances 1..=n (instance 0 is a prefill instance) of 1,000 tokens each, with
    /// `(running, kv_used_blocks)` as their last report, in 10-token blocks.
    fn fleet(decode: &[(u32, u32)]) -> FleetView {
        let mut f = FleetView::default();
        f.set_role(InstanceId(0), Role::Prefill);
        f.up(InstanceId(0), 1_000);
        for (i, &(running, used)) in decode.iter().enumerate() {
            let id = InstanceId(i as u32 + 1);
            f.set_role(id, Role::Decode);
            f.up(id, 1_000);
            let v = f.get_mut(id).expect("just added");
            v.load = Load { running, kv_used_blocks: used, kv_total_blocks: 100, ..Load::default() };
        }
        f
    }

    fn pick(f: &FleetView, reserved: &[Reserved], now_tokens: u64, peak_tokens: u64) -> Option<InstanceId> {
        let model = DecodeModel { base_us: 1_000.0, per_seq_us: 100.0, per_kv_token_us: 1.0 };
        let link = TransferHints { bytes_per_token: 1.0, bytes_per_s: 1e9, latency: Dur(10) };
        pick_decode(f, ModelId::default(), reserved, KvNeed { now_tokens, peak_tokens }, 10, &model, &link)
            .map(|p| p.instance)
    }

    #[test]
    fn the_least_loaded_decode_instance_with_room_wins_and_prefill_instances_never_do() {
        let f = fleet(&[(8, 50), (2, 20), (2, 30)]);
        assert_eq!(pick(&f, &[], 100, 200), Some(InstanceId(2)));
    }

    #[test]
    fn room_for_the_whole_output_beats_a_faster_step() {
        // Instance 2 is lighter but has room for the prompt only (150 free tokens).
        let f = fleet(&[(8, 40), (1, 85)]);
        assert_eq!(pick(&f, &[], 100, 300), Some(InstanceId(1)));
        assert_eq!(pick(&f, &[], 100, 140), Some(InstanceId(2)));
    }

    #[test]
    fn kv_sent_since_the_last_report_counts_and_no_room_means_wait() {
        let f = fleet(&[(0, 0)]);
        assert_eq!(pick(&f, &[], 1_000, 1_000), Some(InstanceId(1)));
        let reserved = [Reserved::default(), Reserved { kv_tokens: 500, seqs: 1 }];
        assert_eq!(pick(&f, &reserved, 600, 600), None);
    }
}
