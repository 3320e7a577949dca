//! # skein-transporter
//!
//! Carries [`ChangeRecord`]s from the extractor to the appliers, keyed by
//! entity + root key so every change of one aggregate lands in one
//! partition, in source order.
//!
//! The embedded default is [`InProcess`]: one bounded crossbeam channel per
//! partition. There the extractor's acknowledgement is end to end: a batch
//! is acknowledged only when every partition's applier has committed its
//! slice to the sidecar (or found nothing new in it).

pub mod kafka;

use std::time::Duration;

use skein_common::record::partition_for;
use skein_common::{ChangeRecord, SourcePosition};

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Transport failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An applier stopped (its receiving side is gone).
    #[error("partition {partition}: the applier is gone")]
    Disconnected { partition: u32 },
    /// An applier reported that it could not commit its slice.
    #[error("partition {partition}: the applier failed: {message}")]
    ApplierFailed { partition: u32, message: String },
    /// The Kafka broker did not take or acknowledge a record.
    #[error("kafka: {message}")]
    Broker { message: String },
}

impl Error {
    /// A gone or failed applier is not fixed by sending again.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// One extractor batch: whole transactions in `(lower, upper]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Extractor batch sequence number (for logs).
    pub seq: u64,
    /// Exclusive lower bound (the marker the batch started from).
    pub lower: SourcePosition,
    /// Inclusive upper bound (commit end of the last transaction).
    pub upper: SourcePosition,
    /// The source reported lost changes before this batch.
    pub has_data_loss: bool,
    /// The records, in source order.
    pub records: Vec<ChangeRecord>,
}

/// What an applier answers for one slice.
pub type Ack = std::result::Result<(), String>;

/// One partition's part of a batch, with the way to acknowledge it.
#[derive(Debug)]
pub struct Slice {
    /// The partition.
    pub partition: u32,
    /// The batch, holding only this partition's records.
    pub batch: Batch,
    ack: tokio::sync::oneshot::Sender<Ack>,
}

impl Slice {
    /// Acknowledges the slice: `Ok` once it is durably committed (or was
    /// already), `Err` when it could not be.
    pub fn ack(self, result: Ack) {
        // The extractor may have stopped waiting (shutdown): nothing to do then.
        let _ = self.ack.send(result);
    }
}

/// The extractor side of a transport.
///
/// Contract: `send` hands over one batch and returns only when it is
/// acknowledged — for the in-process transport, committed by every
/// partition's applier. Records of one key keep their order. A failed
/// `send` may have been partly applied; resending the same batch is safe
/// because appliers drop positions they already committed.
pub trait Transport {
    /// Sends a batch and waits for its acknowledgement.
    fn send(&self, batch: Batch) -> impl std::future::Future<Output = Result<()>> + Send;
}

/// Bounded in-process channels, one per partition.
#[derive(Clone)]
pub struct InProcess {
    senders: Vec<crossbeam_channel::Sender<Slice>>,
}

/// What waiting for a slice gave.
#[derive(Debug)]
pub enum Recv {
    /// A slice to apply and acknowledge.
    Slice(Slice),
    /// Nothing arrived in time.
    Idle,
    /// The extractor side is gone: shut down.
    Closed,
}

/// The applier side of one in-process partition.
pub struct PartitionReceiver {
    /// The partition number.
    pub partition: u32,
    rx: crossbeam_channel::Receiver<Slice>,
}

impl PartitionReceiver {
    /// Waits up to `timeout` for the next slice.
    pub fn recv_timeout(&self, timeout: Duration) -> Recv {
        match self.rx.recv_timeout(timeout) {
            Ok(s) => Recv::Slice(s),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => Recv::Idle,
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => Recv::Closed,
        }
    }
}

impl InProcess {
    /// Creates `partitions` channels holding at most `capacity` slices each.
    pub fn new(partitions: u32, capacity: usize) -> (InProcess, Vec<PartitionReceiver>) {
        let mut senders = vec![];
        let mut receivers = vec![];
        for p in 0..partitions.max(1) {
            let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
            senders.push(tx);
            receivers.push(PartitionReceiver { partition: p, rx });
        }
        (InProcess { senders }, receivers)
    }

    /// Number of partitions.
    pub fn partitions(&self) -> u32 {
        self.senders.len() as u32
    }
}

/// Splits a batch into per-partition batches by the frozen key hash.
pub fn split(batch: &Batch, partitions: u32) -> Vec<Batch> {
    let mut parts: Vec<Batch> = (0..partitions)
        .map(|_| Batch {
            records: vec![],
            ..batch.clone_header()
        })
        .collect();
    for r in &batch.records {
        let p = partition_for(&r.transport_key(), partitions) as usize;
        parts[p].records.push(r.clone());
    }
    parts
}

impl Batch {
    fn clone_header(&self) -> Batch {
        Batch {
            seq: self.seq,
            lower: self.lower,
            upper: self.upper,
            has_data_loss: self.has_data_loss,
            records: vec![],
        }
    }
}

impl Transport for InProcess {
    async fn send(&self, batch: Batch) -> Result<()> {
        let parts = split(&batch, self.partitions());
        let mut waits = vec![];
        for (p, part) in parts.into_iter().enumerate() {
            let partition = p as u32;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let slice = Slice {
                partition,
                batch: part,
                ack: tx,
            };
            // Bounded: when an applier is behind, wait (off the async
            // workers) for room instead of buffering without limit.
            let sender = self.senders[p].clone();
            tokio::task::spawn_blocking(move || sender.send(slice))
                .await
                .map_err(|_| Error::Disconnected { partition })?
                .map_err(|_| Error::Disconnected { partition })?;
            waits.push((partition, rx));
        }
        for (partition, rx) in waits {
            match rx.await {
                Ok(Ok(())) => {}
                Ok(Err(message)) => return Err(Error::ApplierFailed { partition, message }),
                Err(_) => return Err(Error::Disconnected { partition }),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use skein_common::{ChangePosition, Op, PgLsn, RootKey};

    use super::*;

    fn rec(key: &str, seq: u32) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(key.into())]),
            table: "public.customer".into(),
            op: Op::Update,
            position: ChangePosition {
                commit: PgLsn(100).into(),
                seq,
            },
            tx_id: 1,
            commit_time_micros: 0,
        }
    }

    #[test]
    fn split_keeps_one_key_in_one_partition_in_order() {
        let records: Vec<_> = (0..200).map(|i| rec(&(i % 20).to_string(), i)).collect();
        let b = Batch {
            seq: 1,
            lower: PgLsn(1).into(),
            upper: PgLsn(100).into(),
            has_data_loss: false,
            records,
        };
        let parts = split(&b, 4);
        assert_eq!(parts.iter().map(|p| p.records.len()).sum::<usize>(), 200);
        for p in &parts {
            assert_eq!(p.upper, SourcePosition::Pg(PgLsn(100)));
            for k in 0..20 {
                let seqs: Vec<u32> = p
                    .records
                    .iter()
                    .filter(|r| r.root_key.0[0].as_deref() == Some(&k.to_string()))
                    .map(|r| r.position.seq)
                    .collect();
                assert!(seqs.windows(2).all(|w| w[0] < w[1]));
            }
        }
        for k in 0..20 {
            let holders = parts
                .iter()
                .filter(|p| {
                    p.records
                        .iter()
                        .any(|r| r.root_key.0[0].as_deref() == Some(&k.to_string()))
                })
                .count();
            assert_eq!(holders, 1);
        }
    }

    #[tokio::test]
    async fn send_waits_for_every_partition_and_reports_failures() {
        let (t, rxs) = InProcess::new(2, 1);
        let appliers = std::thread::spawn(move || {
            for (i, rx) in rxs.iter().enumerate() {
                let Recv::Slice(s) = rx.recv_timeout(Duration::from_secs(5)) else {
                    panic!("no slice")
                };
                s.ack(if i == 0 { Ok(()) } else { Err("boom".into()) });
            }
        });
        let b = Batch {
            seq: 1,
            lower: PgLsn(1).into(),
            upper: PgLsn(2).into(),
            has_data_loss: false,
            records: vec![rec("1", 0)],
        };
        let e = t.send(b).await.unwrap_err();
        assert!(
            matches!(e, Error::ApplierFailed { partition: 1, .. }),
            "{e}"
        );
        appliers.join().unwrap();
    }
}
