//! Micro-batches: a step cut into consecutive parts, so the stages of a
//! pipeline work at once.
//!
//! A pipeline stage hands its rows on only when it has run them all, so a
//! step run whole keeps one stage busy at a time. Cut into parts, stage `s`
//! runs part `m + 1` while stage `s + 1` runs part `m`: the in-process send
//! is buffered (and a device send is asynchronous), so this only needs every
//! rank to run the same parts in the same order, and the last stage to put
//! the logits of all parts back in the order they were asked for.
//!
//! A part is a range of the step's rows. A sequence whose rows straddle a
//! cut is a prompt chunk cut in two: the later piece's `cached` grows by the
//! rows before it, which the earlier part has written into the KV cache by
//! the time the later part runs on the same rank. Only the piece that ends
//! where the sequence's rows end samples.

use crate::scheduler::{ScheduledSeq, SchedulerOutput};

/// How many parts a pipeline cuts `step` into when a part should carry about
/// `microbatch_rows` rows: one (no cut) when `microbatch_rows` is 0 or the
/// step carries no more prompt rows than that; else enough parts of at most
/// `microbatch_rows` rows each. A pure function of the step, so every rank
/// computes the same number.
pub fn microbatch_parts(step: &SchedulerOutput, microbatch_rows: usize) -> usize {
    if microbatch_rows == 0 || step.shape().prefill_rows <= microbatch_rows {
        return 1;
    }
    step.tokens.len().div_ceil(microbatch_rows)
}

/// Where part `k` of `parts` over `rows` rows begins: the cuts are as even
/// as whole rows allow.
fn cut(rows: usize, parts: usize, k: usize) -> usize {
    rows * k / parts
}

/// Cut `step` into `parts` consecutive parts of about equal rows (fewer
/// when the step has fewer rows), each with the rows of `logit_rows` that
/// fall in it, renumbered from the part's first row and in the order they
/// were asked for. One part is the step itself.
///
/// Every row lands in exactly one part, in order; each sequence's pieces
/// keep its page table, and a piece's `cached` is the sequence's plus the
/// rows of the pieces before it. The step's decode rows are the one-row
/// sequences: they are never cut, and each part counts those it holds.
/// Preempted and out-of-capacity lists ride on the first part.
pub fn split_step(
    step: &SchedulerOutput,
    logit_rows: &[usize],
    parts: usize,
) -> Vec<(SchedulerOutput, Vec<usize>)> {
    let rows = step.tokens.len();
    let parts = parts.clamp(1, rows.max(1));
    if parts == 1 {
        return vec![(step.clone(), logit_rows.to_vec())];
    }
    let mut decode_left = step.decode_rows;
    (0..parts)
        .map(|k| {
            let (lo, hi) = (cut(rows, parts, k), cut(rows, parts, k + 1));
            let seqs: Vec<ScheduledSeq> = step
                .seqs
                .iter()
                .filter(|s| s.row_start < hi && s.row_start + s.rows > lo)
                .map(|s| {
                    let (start, end) = (s.row_start.max(lo), (s.row_start + s.rows).min(hi));
                    ScheduledSeq {
                        id: s.id,
                        row_start: start - lo,
                        rows: end - start,
                        cached: s.cached + (start - s.row_start),
                        pages: s.pages.clone(),
                        samples: s.samples && end == s.row_start + s.rows,
                        state_slot: s.state_slot,
                    }
                })
                .collect();
            let singles = step.seqs.iter().filter(|s| s.rows == 1 && (lo..hi).contains(&s.row_start)).count();
            let decode_rows = singles.min(decode_left);
            decode_left -= decode_rows;
            let first = k == 0;
            let part = SchedulerOutput {
                tokens: step.tokens[lo..hi].to_vec(),
                positions: step.positions[lo..hi].to_vec(),
                seqs,
                preempted: if first { step.preempted.clone() } else { Vec::new() },
                out_of_capacity: if first { step.out_of_capacity.clone() } else { Vec::new() },
                decode_rows,
            };
            let logits = logit_rows.iter().filter(|&&r| (lo..hi).contains(&r)).map(|&r| r - lo).collect();
            (part, logits)
        })
        .collect()
}

/// For each of `logit_rows` (rows of a step of `rows` rows cut into
/// `parts` parts by [`split_step`]): the part whose logits hold it and its
/// place among that part's logit rows.
pub fn logit_places(rows: usize, logit_rows: &[usize], parts: usize) -> Vec<(usize, usize)> {
    let parts = parts.clamp(1, rows.max(1));
    let mut seen = vec![0usize; parts];
    logit_rows
        .iter()
        .map(|&r| {
            // The part k with cut(k) <= r < cut(k + 1).
            let k = (0..parts).rfind(|&k| cut(rows, parts, k) <= r).unwrap_or(0);
            seen[k] += 1;
            (k, seen[k] - 1)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use corridor_units::{PageId, RequestId, TokenId};

    fn seq(id: u64, row_start: usize, rows: usize, cached: usize, samples: bool) -> ScheduledSeq {
        ScheduledSeq {
            id: RequestId(id),
            row_start,
            rows,
            cached,
            pages: vec![PageId(id as u32 * 10), PageId(id as u32 * 10 + 1)],
            samples,
            state_slot: None,
        }
    }

    /// Two decodes, a prompt chunk that does not sample, a whole prompt.
    fn step() -> SchedulerOutput {
        let seqs = vec![
            seq(1, 0, 1, 17, true),
            seq(2, 1, 1, 5, true),
            seq(3, 2, 13, 4, false),
            seq(4, 15, 9, 0, true),
        ];
        let rows = 24;
        let mut positions = vec![17, 5];
        positions.extend(4..17);
        positions.extend(0..9);
        SchedulerOutput {
            tokens: (100..100 + rows as u32).map(TokenId).collect(),
            positions,
            seqs,
            preempted: vec![RequestId(9)],
            out_of_capacity: vec![RequestId(8)],
            decode_rows: 2,
        }
    }

    /// Every row of `whole` appears once, in order, with its sequence's
    /// position, page table and cached count.
    fn check(whole: &SchedulerOutput, logit_rows: &[usize], parts: &[(SchedulerOutput, Vec<usize>)]) {
        let tokens: Vec<TokenId> = parts.iter().flat_map(|p| p.0.tokens.clone()).collect();
        let positions: Vec<u32> = parts.iter().flat_map(|p| p.0.positions.clone()).collect();
        assert_eq!((tokens, positions), (whole.tokens.clone(), whole.positions.clone()));
        let mut offset = 0;
        let mut rows_of: std::collections::HashMap<RequestId, usize> = Default::default();
        let mut logits = Vec::new();
        for (p, l) in parts {
            assert!(!p.tokens.is_empty());
            assert_eq!(p.positions.len(), p.tokens.len());
            let mut covered = 0;
            for s in &p.seqs {
                let orig = whole.seqs.iter().find(|o| o.id == s.id).unwrap();
                let done = rows_of.entry(s.id).or_default();
                // The piece follows the rows of the pieces before it.
                assert_eq!(s.row_start + offset, orig.row_start + *done, "seq {}", s.id);
                assert_eq!(s.cached, orig.cached + *done, "seq {}", s.id);
                assert_eq!(s.pages, orig.pages);
                *done += s.rows;
                assert_eq!(s.samples, orig.samples && *done == orig.rows, "seq {}", s.id);
                // Positions stay what the sequence's cached count says.
                for r in 0..s.rows {
                    assert_eq!(p.positions[s.row_start + r] as usize, s.cached + r);
                }
                covered += s.rows;
            }
            assert_eq!(covered, p.tokens.len());
            logits.extend(l.iter().map(|r| r + offset));
            assert!(l.iter().all(|&r| r < p.tokens.len()));
            offset += p.tokens.len();
        }
        for o in &whole.seqs {
            assert_eq!(rows_of[&o.id], o.rows, "seq {} rows conserved", o.id);
        }
        // The logit rows, mapped back, are the ones asked for, and
        // `logit_places` finds each of them.
        let offsets: Vec<usize> =
            parts.iter().scan(0, |o, p| Some(std::mem::replace(o, *o + p.0.tokens.len()))).collect();
        let places = logit_places(whole.tokens.len(), logit_rows, parts.len());
        for (&r, &(k, j)) in logit_rows.iter().zip(&places) {
            assert_eq!(parts[k].1[j] + offsets[k], r);
        }
        assert_eq!(logits.len(), logit_rows.len());
        assert_eq!(parts.iter().map(|p| p.0.decode_rows).sum::<usize>(), whole.decode_rows);
        assert_eq!(parts.iter().flat_map(|p| p.0.preempted.clone()).collect::<Vec<_>>(), whole.preempted);
    }

    #[test]
    fn split_conserves_rows_and_keeps_positions_and_cached_consistent() {
        let whole = step();
        let logit_rows = [0, 1, 23];
        for parts in 1..=30 {
            let split = split_step(&whole, &logit_rows, parts);
            assert_eq!(split.len(), parts.min(24), "{parts}");
            check(&whole, &logit_rows, &split);
        }
        // Three parts of 8 rows: seq 3 (rows 2..15) is cut twice, seq 4
        // (rows 15..24) once; only their last pieces sample.
        let split = split_step(&whole, &logit_rows, 3);
        // (id, row_start, rows, cached, samples) of each part's pieces.
        type Piece = (u64, usize, usize, usize, bool);
        let pieces: Vec<Vec<Piece>> = split
            .iter()
            .map(|(p, _)| {
                p.seqs.iter().map(|s| (s.id.get(), s.row_start, s.rows, s.cached, s.samples)).collect()
            })
            .collect();
        assert_eq!(
            pieces,
            vec![
                vec![(1, 0, 1, 17, true), (2, 1, 1, 5, true), (3, 2, 6, 4, false)],
                vec![(3, 0, 7, 10, false), (4, 7, 1, 0, false)],
                vec![(4, 0, 8, 1, true)],
            ]
        );
        let logits: Vec<Vec<usize>> = split.iter().map(|p| p.1.clone()).collect();
        assert_eq!(logits, vec![vec![0, 1], vec![], vec![7]]);
        assert_eq!(split.iter().map(|p| p.0.decode_rows).collect::<Vec<_>>(), vec![2, 0, 0]);
        assert_eq!(
            (split[0].0.out_of_capacity.clone(), split[1].0.preempted.clone()),
            (vec![RequestId(8)], vec![])
        );
    }

    #[test]
    fn logit_rows_asked_out_of_order_are_placed_back() {
        let whole = step();
        let logit_rows = [23, 0, 14, 1];
        let split = split_step(&whole, &logit_rows, 3);
        assert_eq!(split.iter().map(|p| p.1.clone()).collect::<Vec<_>>(), vec![vec![0, 1], vec![6], vec![7]]);
        // 23 is part 2's first logit row, 0 part 0's first, 14 part 1's
        // first, 1 part 0's second.
        assert_eq!(logit_places(24, &logit_rows, 3), vec![(2, 0), (0, 0), (1, 0), (0, 1)]);
        check(&whole, &logit_rows, &split);
    }

    #[test]
    fn parts_follow_the_prompt_rows() {
        let whole = step(); // 24 rows, 22 of them prompt rows
        assert_eq!(microbatch_parts(&whole, 0), 1, "0 is off");
        assert_eq!(microbatch_parts(&whole, 22), 1, "not more prompt rows than a part");
        assert_eq!(microbatch_parts(&whole, 21), 2);
        assert_eq!(microbatch_parts(&whole, 8), 3);
        // A 512-row prompt chunk at the default makes about two parts per
        // stage of a 3-stage pipeline.
        let chunk = SchedulerOutput {
            tokens: vec![TokenId(0); 512],
            positions: (0..512).collect(),
            seqs: vec![seq(1, 0, 512, 0, true)],
            ..SchedulerOutput::default()
        };
        assert_eq!(microbatch_parts(&chunk, crate::ranks::DEFAULT_MICROBATCH_ROWS), 6);
    }
}
