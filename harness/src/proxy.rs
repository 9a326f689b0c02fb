//! A TCP fault proxy between a client and one server: added latency per direction (so tests run
//! at cross-region round trips), a blackhole (bytes are held, connections stay open, nothing
//! answers), connection resets, and a bandwidth limit. Order within a connection is kept.
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// The faults in force now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Faults {
    /// Delay of bytes from the client to the server.
    pub latency_up: Duration,
    /// Delay of bytes from the server to the client.
    pub latency_down: Duration,
    /// Hold every byte in both directions until lifted.
    pub blackhole: bool,
    /// Bytes per second in each direction, if limited.
    pub bandwidth: Option<u64>,
    /// Bumped to reset every open connection.
    reset_epoch: u64,
}

pub struct FaultProxy {
    addr: SocketAddr,
    target: SocketAddr,
    faults: Arc<watch::Sender<Faults>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        // Connections end with the epoch: their tasks watch it.
        self.faults.send_modify(|f| f.reset_epoch += 1);
    }
}

impl FaultProxy {
    /// Listens on a free 127.0.0.1 port and forwards every connection to `target`.
    pub async fn start(target: SocketAddr) -> anyhow::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (tx, _) = watch::channel(Faults::default());
        let faults = Arc::new(tx);
        let accept_faults = faults.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let faults = accept_faults.subscribe();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(target).await {
                        connection(client, server, faults).await;
                    }
                });
            }
        });
        Ok(FaultProxy { addr, target, faults, task })
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server behind it.
    pub fn target(&self) -> SocketAddr {
        self.target
    }

    /// `<scheme>://127.0.0.1:<port>`.
    pub fn endpoint(&self, scheme: &str) -> String {
        format!("{scheme}://{}", self.addr)
    }

    pub fn faults(&self) -> Faults {
        self.faults.borrow().clone()
    }

    /// A round trip of `rtt`, half in each direction.
    pub fn set_rtt(&self, rtt: Duration) {
        self.faults.send_modify(|f| {
            f.latency_up = rtt / 2;
            f.latency_down = rtt / 2;
        });
    }

    pub fn set_latency(&self, up: Duration, down: Duration) {
        self.faults.send_modify(|f| {
            f.latency_up = up;
            f.latency_down = down;
        });
    }

    /// Holds every byte (true) or lets them flow again, held ones first (false).
    pub fn set_blackhole(&self, on: bool) {
        self.faults.send_modify(|f| f.blackhole = on);
    }

    pub fn set_bandwidth(&self, bytes_per_second: Option<u64>) {
        self.faults.send_modify(|f| f.bandwidth = bytes_per_second);
    }

    /// Resets every open connection (new ones are accepted as usual).
    pub fn reset_connections(&self) {
        self.faults.send_modify(|f| f.reset_epoch += 1);
    }
}

async fn connection(client: TcpStream, server: TcpStream, faults: watch::Receiver<Faults>) {
    let epoch = faults.borrow().reset_epoch;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(client_read, server_write, faults.clone(), true);
    let down = pipe(server_read, client_write, faults.clone(), false);
    let mut reset = faults.clone();
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = reset.wait_for(|f| f.reset_epoch != epoch) => {
            // Dropping the halves here closes both sockets: the client sees the connection end.
        }
    }
}

/// Copies one direction, each chunk released at arrival + latency, in order.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    faults: watch::Receiver<Faults>,
    upstream: bool,
) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send((Instant::now(), buf[..n].to_vec())).is_err() {
                        break;
                    }
                }
            }
        }
        // Dropping tx ends the writer once it has flushed what is queued.
    };
    let writer = async move {
        let mut faults = faults;
        while let Some((arrived, bytes)) = rx.recv().await {
            let latency = {
                let f = faults.borrow();
                if upstream { f.latency_up } else { f.latency_down }
            };
            tokio::time::sleep_until(arrived + latency).await;
            if faults.wait_for(|f| !f.blackhole).await.is_err() {
                return;
            }
            let bandwidth = faults.borrow().bandwidth;
            if let Some(bps) = bandwidth.filter(|b| *b > 0) {
                tokio::time::sleep(Duration::from_secs_f64(bytes.len() as f64 / bps as f64)).await;
            }
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
