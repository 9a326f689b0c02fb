//! The two lease calls etcd-client cannot make, over a [`RawChannel`]:
//! - keepalive streams that carry any lease id (its `LeaseKeeper` renews one lease per stream,
//!   and opening one fails unless that lease exists), so that thousands of leases share a few
//!   streams;
//! - a lease's key listing decoded up to the KV client's limit ([`MAX_DECODE_BYTES`]): its
//!   lease client keeps tonic's 4 MiB default, which a shard of long keys passes.
//!
//! The messages are etcd's own (`etcdserverpb/rpc.proto`), declared here field for field.
use crate::mirror::target::{MAX_DECODE_BYTES, RawChannel};
use tokio::sync::mpsc;

#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseHeader {
    #[prost(uint64, tag = "1")]
    pub cluster_id: u64,
    #[prost(uint64, tag = "2")]
    pub member_id: u64,
    #[prost(int64, tag = "3")]
    pub revision: i64,
    #[prost(uint64, tag = "4")]
    pub raft_term: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseKeepAliveResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    /// Seconds the lease has now; 0 or less when it is gone.
    #[prost(int64, tag = "3")]
    pub ttl: i64,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseTimeToLiveRequest {
    #[prost(int64, tag = "1")]
    pub id: i64,
    #[prost(bool, tag = "2")]
    pub keys: bool,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseTimeToLiveResponse {
    #[prost(message, optional, tag = "1")]
    pub header: Option<ResponseHeader>,
    #[prost(int64, tag = "2")]
    pub id: i64,
    #[prost(int64, tag = "3")]
    pub ttl: i64,
    #[prost(int64, tag = "4")]
    pub granted_ttl: i64,
    #[prost(bytes = "vec", repeated, tag = "5")]
    pub keys: Vec<Vec<u8>>,
}

const KEEP_ALIVE: &str = "/etcdserverpb.Lease/LeaseKeepAlive";
const TIME_TO_LIVE: &str = "/etcdserverpb.Lease/LeaseTimeToLive";

fn grpc(raw: &RawChannel) -> tonic::client::Grpc<tonic::transport::Channel> {
    tonic::client::Grpc::new(raw.channel.clone()).max_decoding_message_size(MAX_DECODE_BYTES)
}

async fn ready(grpc: &mut tonic::client::Grpc<tonic::transport::Channel>) -> Result<(), tonic::Status> {
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(format!("the connection is not ready: {e}")))
}

/// The keys attached to `lease` (None when the lease is gone).
pub async fn lease_keys(raw: &RawChannel, lease: i64) -> Result<Option<Vec<Vec<u8>>>, tonic::Status> {
    let mut grpc = grpc(raw);
    ready(&mut grpc).await?;
    let codec = tonic_prost::ProstCodec::<LeaseTimeToLiveRequest, LeaseTimeToLiveResponse>::default();
    let request = raw.request(LeaseTimeToLiveRequest { id: lease, keys: true });
    let path = http::uri::PathAndQuery::from_static(TIME_TO_LIVE);
    let resp = grpc.unary(request, path, codec).await?.into_inner();
    Ok((resp.ttl > 0).then_some(resp.keys))
}

/// One LeaseKeepAlive stream: requests for any lease go in, answers come back in order per lease.
pub struct KeepAliveStream {
    requests: mpsc::UnboundedSender<LeaseKeepAliveRequest>,
    answers: tonic::Streaming<LeaseKeepAliveResponse>,
}

impl KeepAliveStream {
    /// Opens a stream with requests for `first` already queued: etcd sends a stream's headers with
    /// its first answer, so opening waits for one.
    pub async fn open(raw: &RawChannel, first: &[i64]) -> Result<KeepAliveStream, tonic::Status> {
        let (requests, queued) = mpsc::unbounded_channel::<LeaseKeepAliveRequest>();
        for id in first {
            let _ = requests.send(LeaseKeepAliveRequest { id: *id });
        }
        let outgoing = futures::stream::unfold(queued, |mut queued| async move {
            queued.recv().await.map(|request| (request, queued))
        });
        let mut grpc = grpc(raw);
        ready(&mut grpc).await?;
        let codec = tonic_prost::ProstCodec::<LeaseKeepAliveRequest, LeaseKeepAliveResponse>::default();
        let path = http::uri::PathAndQuery::from_static(KEEP_ALIVE);
        let answers = grpc.streaming(raw.request(outgoing), path, codec).await?.into_inner();
        Ok(KeepAliveStream { requests, answers })
    }

    /// Queues a renewal of each lease.
    pub fn send(&self, leases: &[i64]) -> Result<(), tonic::Status> {
        for id in leases {
            self.requests
                .send(LeaseKeepAliveRequest { id: *id })
                .map_err(|_| tonic::Status::unavailable("the keepalive stream is closed"))?;
        }
        Ok(())
    }

    /// The next answer; None when the etcd closed the stream.
    pub async fn answer(&mut self) -> Result<Option<LeaseKeepAliveResponse>, tonic::Status> {
        self.answers.message().await
    }
}
