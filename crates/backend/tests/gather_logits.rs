//! `collective::gather_logits`: logits as whole rows on the rank that
//! samples, read straight into the result only when no other rank takes part.

use corridor_backend::collective::{
    gather_logits, CollectiveError, Group, GroupShape, OpKind, Solo, ThreadGroup,
};
use std::time::Duration;

/// A `[rows, width]` block whose value names its row and global column.
fn block(rows: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    (0..rows).flat_map(|r| cols.clone().map(move |c| (r * 100 + c) as f32)).collect()
}

#[test]
fn one_rank_with_every_column_reads_straight_into_the_result() {
    let solo = Solo::new();
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    let mut reads = 0;
    gather_logits::<_, CollectiveError>(&solo, 2, 0..4, 4, &mut scratch, &mut out, |buf| {
        reads += 1;
        buf.extend(block(2, 0..4));
        Ok(())
    })
    .unwrap();
    assert_eq!(reads, 1);
    assert_eq!(out, block(2, 0..4));
    assert!(scratch.is_empty(), "the rows went through the scratch buffer");
    assert_eq!(solo.census().get(OpKind::AllGather), 0, "no gather was needed");
}

#[test]
fn a_share_of_the_columns_is_placed_at_its_offset() {
    let solo = Solo::new();
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    gather_logits::<_, CollectiveError>(&solo, 2, 2..5, 8, &mut scratch, &mut out, |buf| {
        buf.extend(block(2, 2..5));
        Ok(())
    })
    .unwrap();
    assert_eq!(out.len(), 2 * 8);
    for r in 0..2 {
        assert_eq!(&out[r * 8 + 2..r * 8 + 5], &block(2, 2..5)[r * 3..(r + 1) * 3]);
    }
    assert_eq!(solo.census().get(OpKind::AllGather), 1);
}

#[test]
fn a_failed_read_enters_no_gather() {
    let solo = Solo::new();
    let (mut scratch, mut out) = (Vec::new(), Vec::new());
    let err = CollectiveError::Aborted { rank: solo.rank(), op: OpKind::AllGather, reason: "read".into() };
    let got = gather_logits(&solo, 2, 2..5, 8, &mut scratch, &mut out, |_| Err(err.clone()));
    assert_eq!(got, Err(err));
    assert_eq!(solo.census().get(OpKind::AllGather), 0);
}

#[test]
fn a_tensor_group_assembles_whole_rows_on_rank_zero_only() {
    let (_group, ranks) = ThreadGroup::new(2, GroupShape::Tensor, Duration::from_secs(10));
    let shares = [0..3, 3..8];
    let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .zip(shares.clone())
            .map(|(rank, cols)| {
                s.spawn(move || {
                    let (mut scratch, mut out) = (Vec::new(), Vec::new());
                    gather_logits::<_, CollectiveError>(
                        rank,
                        2,
                        cols.clone(),
                        8,
                        &mut scratch,
                        &mut out,
                        |buf| {
                            buf.extend(block(2, cols));
                            Ok(())
                        },
                    )
                    .unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(outs[0], block(2, 0..8));
    assert!(outs[1].is_empty(), "only the sampling rank holds the rows");
}
