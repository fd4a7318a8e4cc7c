//! The `tcp` backend: CPU ranks as separate processes (started by `fsdp-app launch`, torchrun,
//! srun or mpirun), joined through MASTER_ADDR:MASTER_PORT.
//!
//! Rank 0 listens there and hosts the rendezvous of the `local` backend; every other rank holds
//! one connection to it, and a proxy thread on rank 0 performs that rank's collectives on its
//! behalf. So the collective semantics (and their timeouts) are exactly the local backend's.
//! A process that dies closes its socket: rank 0 turns that into an abort naming the rank, and
//! the other ranks see their pending collective fail. When rank 0 dies, the others see their
//! connection close and stop with a message saying so.
//!
//! Traffic goes through rank 0, which suits CPU jobs on one or a few nodes; GPUs use NCCL.

use std::io::{BufReader, BufWriter};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

mod wire;

use wire::*;

use super::env::DistEnv;
use super::local::create_process_groups;
use super::{Collective, ProcessGroups};

/// On rank 0: the proxies serving the other ranks. Rank 0 should not exit on a failure before
/// they have told the other ranks why (`wait_for_ranks`), or the others only see a closed socket.
#[derive(Clone, Default)]
pub struct Proxies(Arc<std::sync::atomic::AtomicUsize>);

impl Proxies {
    /// Waits until every other rank has disconnected, at most `limit`.
    pub fn wait_for_ranks(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.0.load(std::sync::atomic::Ordering::SeqCst) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Joins the job described by `env`. Rank 0 returns once every rank has connected.
pub fn connect(env: &DistEnv, shard_size: usize, timeout: Duration) -> Result<(ProcessGroups, Proxies)> {
    if shard_size == 0 || !env.world_size.is_multiple_of(shard_size) {
        bail!("shard group size {shard_size} does not divide world size {}", env.world_size);
    }
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let proxies = Proxies::default();
    let groups = if env.rank == 0 { host(env, shard_size, timeout, &addr, &proxies)? } else { join(env, shard_size, timeout, &addr)? };
    Ok((groups, proxies))
}

fn host(env: &DistEnv, shard_size: usize, timeout: Duration, addr: &str, proxies: &Proxies) -> Result<ProcessGroups> {
    let listener = TcpListener::bind(addr).with_context(|| format!("rank 0: cannot listen on MASTER_ADDR:MASTER_PORT = {addr}"))?;
    listener.set_nonblocking(true)?;
    let mut groups: Vec<Option<ProcessGroups>> = create_process_groups(env.world_size, shard_size, timeout).into_iter().map(Some).collect();
    let mine = groups[0].take().unwrap();
    let deadline = Instant::now() + timeout;
    let mut joined = vec![false; env.world_size];
    joined[0] = true;
    while joined.iter().any(|j| !j) {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
                let mut reader = BufReader::new(stream.try_clone()?);
                let hello = read_frame(&mut reader).context("rank 0: reading a rank's handshake")?;
                let mut r = Reader { b: &hello };
                let (magic, rank, world, shards) = (r.u64()? as u32, r.u64()? as usize, r.u64()? as usize, r.u64()? as usize);
                if magic != MAGIC || world != env.world_size || shards != shard_size || rank == 0 || rank >= world || joined[rank] {
                    bail!(
                        "rank 0: a process joined as rank {rank} of {world} (shard groups of {shards}); this job is {} ranks \
                         with shard groups of {shard_size}, and rank {rank} {}",
                        env.world_size,
                        if rank < world && joined[rank] { "already joined" } else { "is not expected" }
                    );
                }
                joined[rank] = true;
                let g = groups[rank].take().unwrap();
                let mut writer = BufWriter::new(stream);
                write_frame(&mut writer, &Msg::default().u64(MAGIC as u64).0)?;
                let active = proxies.0.clone();
                active.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::Builder::new().name(format!("proxy-rank-{rank}")).spawn(move || {
                    proxy(rank, g, reader, writer);
                    active.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() > deadline {
                    let missing: Vec<usize> = joined.iter().enumerate().filter(|(_, j)| !**j).map(|(r, _)| r).collect();
                    let reason = format!("rank(s) {missing:?} did not join at {addr} within {:.0}s", timeout.as_secs_f64());
                    mine.abort(&reason);
                    bail!("rank 0: {reason}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e).context("rank 0: accepting connections"),
        }
    }
    Ok(mine)
}

/// Test hook (cargo feature `fault-injection`): rank 0's proxies answer a barrier late, so
/// rank 0's own thread is past the barrier well before the other ranks hear of it, which is
/// how a run's last barrier races rank 0's exit. A release build has no such hook.
fn slow_barrier_reply() {
    #[cfg(feature = "fault-injection")]
    if let Some(ms) = std::env::var("FSDP_FAULT_SLOW_BARRIER_REPLY_MS").ok().and_then(|v| v.parse().ok()) {
        std::thread::sleep(Duration::from_millis(ms));
    }
}

/// Serves one remote rank's collectives on rank 0.
fn proxy(rank: usize, groups: ProcessGroups, mut reader: BufReader<TcpStream>, mut writer: BufWriter<TcpStream>) {
    let gone = |groups: &ProcessGroups| groups.abort(&format!("rank {rank}'s process disconnected (it exited or was killed)"));
    loop {
        let Ok(decoded) = read_request(&mut reader) else {
            gone(&groups);
            return;
        };
        let ok = Msg::default().u8(0);
        let written = match decoded {
            Ok((_, Request::Bye)) => return,
            Ok((_, Request::Abort(why))) => {
                groups.abort(&why);
                continue;
            }
            Ok((group, req)) => {
                let group = match group {
                    0 => &groups.world,
                    1 => &groups.shard,
                    _ => &groups.replicate,
                };
                let result = (|| -> Result<Result<Vec<f32>, Vec<u8>>> {
                    Ok(match req {
                        Request::AllGather(v) => Ok(group.all_gather_owned(v)?),
                        Request::ReduceScatter(v) => Ok(group.reduce_scatter_owned(v)?),
                        Request::AllReduce(mut v) => {
                            group.all_reduce(&mut v)?;
                            Ok(v)
                        }
                        Request::AllReduceF64(mut v) => {
                            group.all_reduce_f64(&mut v)?;
                            Err(ok.f64s(&v).0)
                        }
                        Request::Scatter { root, chunks } => Ok(group.scatter(root, chunks)?),
                        Request::Broadcast { root, bytes } => Err(ok.bytes(&group.broadcast_bytes(root, bytes)?).0),
                        Request::Barrier => {
                            group.barrier()?;
                            slow_barrier_reply();
                            Err(ok.0)
                        }
                        Request::Abort(_) | Request::Bye => unreachable!("handled above"),
                    })
                })();
                match result {
                    Ok(Ok(values)) => write_f32_reply(&mut writer, &values),
                    Ok(Err(reply)) => write_frame(&mut writer, &reply),
                    Err(e) => write_frame(&mut writer, &Msg::default().u8(1).bytes(format!("{e:#}").as_bytes()).0),
                }
            }
            Err(e) => write_frame(&mut writer, &Msg::default().u8(1).bytes(format!("{e:#}").as_bytes()).0),
        };
        if written.is_err() {
            gone(&groups);
            return;
        }
    }
}

struct Connection {
    reader: BufReader<TcpStream>,
    writer: BufWriter<TcpStream>,
}

impl Drop for Connection {
    fn drop(&mut self) {
        let _ = write_frame(&mut self.writer, &Msg::default().u8(Op::Bye as u8).u8(0).0);
    }
}

fn join(env: &DistEnv, shard_size: usize, timeout: Duration, addr: &str) -> Result<ProcessGroups> {
    let deadline = Instant::now() + timeout;
    let stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) => {
                if Instant::now() > deadline {
                    return Err(e).with_context(|| {
                        format!(
                            "rank {}: could not reach rank 0 at MASTER_ADDR:MASTER_PORT = {addr} within {:.0}s",
                            env.rank,
                            timeout.as_secs_f64()
                        )
                    });
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    stream.set_nodelay(true)?;
    // The rendezvous on rank 0 enforces collective timeouts; this bounds a silent rank 0.
    stream.set_read_timeout(Some(timeout + Duration::from_secs(30)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut writer = BufWriter::new(stream);
    let hello = Msg::default().u64(MAGIC as u64).u64(env.rank as u64).u64(env.world_size as u64).u64(shard_size as u64);
    write_frame(&mut writer, &hello.0)?;
    let ack = read_frame(&mut reader).with_context(|| format!("rank {}: rank 0 refused the handshake", env.rank))?;
    if (Reader { b: &ack }).u64()? as u32 != MAGIC {
        bail!("rank {}: {addr} is not an fsdp-app rank 0", env.rank);
    }
    let conn = Arc::new(Mutex::new(Connection { reader, writer }));
    let world = env.world_size;
    let g = |id: u8, rank: usize, size: usize| -> Arc<dyn Collective> {
        Arc::new(RemoteGroup { conn: conn.clone(), id, rank, size, world_rank: env.rank })
    };
    let shard_rank = env.rank % shard_size;
    Ok(ProcessGroups {
        world: g(0, env.rank, world),
        shard: g(1, shard_rank, shard_size),
        replicate: g(2, env.rank / shard_size, world / shard_size),
    })
}

/// One group as seen by a rank other than 0.
struct RemoteGroup {
    conn: Arc<Mutex<Connection>>,
    id: u8,
    rank: usize,
    size: usize,
    world_rank: usize,
}

impl RemoteGroup {
    fn lost(&self, name: &str, e: std::io::Error) -> anyhow::Error {
        anyhow::anyhow!("{name} on rank {}: lost the connection to rank 0 ({e}); rank 0 exited or failed", self.world_rank)
    }

    fn call(&self, op: Op, name: &str, body: impl FnOnce(Msg) -> Msg) -> Result<Vec<u8>> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let msg = body(Msg::default().u8(op as u8).u8(self.id));
        let lost = |e| self.lost(name, e);
        write_frame(&mut c.writer, &msg.0).map_err(lost)?;
        let reply = read_frame(&mut c.reader).map_err(lost)?;
        let mut r = Reader { b: &reply };
        if r.u8()? != 0 {
            bail!("{}", String::from_utf8_lossy(&r.bytes()?));
        }
        Ok(r.b.to_vec())
    }

    /// A collective whose request and reply are f32 values: both go between the socket and
    /// the vectors directly. Through frames, a unit-sized gather was held four times over on
    /// this rank (request, reply, a copy of it, the decoded values).
    fn call_f32s(&self, op: Op, name: &str, values: &[f32]) -> Result<Vec<f32>> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        let lost = |e| self.lost(name, e);
        write_f32s_frame(&mut c.writer, &[op as u8, self.id], values).map_err(lost)?;
        read_f32_reply(&mut c.reader).map_err(lost)?
    }
}

impl Collective for RemoteGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn all_gather(&self, shard: &[f32]) -> Result<Vec<f32>> {
        self.call_f32s(Op::AllGather, "all_gather", shard)
    }
    fn reduce_scatter(&self, full: &[f32]) -> Result<Vec<f32>> {
        self.call_f32s(Op::ReduceScatter, "reduce_scatter", full)
    }
    fn all_reduce(&self, data: &mut [f32]) -> Result<()> {
        let v = self.call_f32s(Op::AllReduce, "all_reduce", data)?;
        data.copy_from_slice(&v);
        Ok(())
    }
    fn all_reduce_f64(&self, data: &mut [f64]) -> Result<()> {
        let v = Reader { b: &self.call(Op::AllReduceF64, "all_reduce_f64", |m| m.f64s(data))? }.f64s()?;
        data.copy_from_slice(&v);
        Ok(())
    }
    fn scatter(&self, root: usize, chunks: Option<Vec<Vec<f32>>>) -> Result<Vec<f32>> {
        let reply = self.call(Op::Scatter, "scatter", |m| {
            let m = m.u64(root as u64);
            match &chunks {
                Some(c) => c.iter().fold(m.u8(1).u64(c.len() as u64), |m, x| m.f32s(x)),
                None => m.u8(0),
            }
        })?;
        Reader { b: &reply }.f32s()
    }
    fn broadcast_bytes(&self, root: usize, bytes: Option<Vec<u8>>) -> Result<Vec<u8>> {
        let reply = self.call(Op::Broadcast, "broadcast", |m| {
            let m = m.u64(root as u64);
            match &bytes {
                Some(b) => m.u8(1).bytes(b),
                None => m.u8(0),
            }
        })?;
        Reader { b: &reply }.bytes()
    }
    fn barrier(&self) -> Result<()> {
        self.call(Op::Barrier, "barrier", |m| m).map(|_| ())
    }
    fn abort(&self, reason: &str) {
        if let Ok(mut c) = self.conn.lock() {
            let msg = Msg::default().u8(Op::Abort as u8).u8(self.id).bytes(reason.as_bytes());
            let _ = write_frame(&mut c.writer, &msg.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests as a remote rank writes them come back whole: f32 values read straight into
    /// their vector (any group), other requests through their frame, and a gather whose count
    /// disagrees with its length is an error, not a short read.
    #[test]
    fn a_request_read_from_the_socket_is_the_request_written() {
        let framed = |m: Msg| {
            let mut w = vec![];
            write_frame(&mut w, &m.0).unwrap();
            w
        };
        let values = [1.5f32, -2.0, 3.25e-7];
        let wire = framed(Msg::default().u8(Op::ReduceScatter as u8).u8(2).f32s(&values));
        match read_request(&mut wire.as_slice()).unwrap().unwrap() {
            (2, Request::ReduceScatter(v)) => assert_eq!(v, values),
            (g, _) => panic!("group {g}: another request"),
        }
        let wire = framed(Msg::default().u8(Op::Scatter as u8).u8(0).u64(1).u8(1).u64(1).f32s(&values));
        match read_request(&mut wire.as_slice()).unwrap().unwrap() {
            (0, Request::Scatter { root: 1, chunks: Some(c) }) => assert_eq!(c, vec![values.to_vec()]),
            _ => panic!("not the scatter written"),
        }
        let wire = framed(Msg::default().u8(Op::Barrier as u8).u8(1));
        assert!(matches!(read_request(&mut wire.as_slice()).unwrap().unwrap(), (1, Request::Barrier)));
        let mut short = Msg::default().u8(Op::AllGather as u8).u8(0).u64(3);
        short.0.extend_from_slice(&1f32.to_le_bytes());
        let e = read_request(&mut framed(short).as_slice()).unwrap().err().expect("a count of 3 with one value");
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    /// A remote rank's f32 request, written from its values, is the frame `Msg` would build,
    /// and the replies it reads back straight into a vector are the values rank 0 wrote, or
    /// the error it sent; a count that disagrees with the length is an error.
    #[test]
    fn f32_requests_and_replies_cross_the_socket_without_a_frame_copy() {
        let values = [1.5f32, -2.0, 3.25e-7, f32::MAX];
        let mut direct = vec![];
        write_f32s_frame(&mut direct, &[Op::AllGather as u8, 1], &values).unwrap();
        let mut framed = vec![];
        write_frame(&mut framed, &Msg::default().u8(Op::AllGather as u8).u8(1).f32s(&values).0).unwrap();
        assert_eq!(direct, framed);

        let mut wire = vec![];
        write_f32_reply(&mut wire, &values).unwrap();
        assert_eq!(read_f32_reply(&mut wire.as_slice()).unwrap().unwrap(), values);
        let mut wire = vec![];
        write_frame(&mut wire, &Msg::default().u8(1).bytes(b"rank 2 timed out in all_gather").0).unwrap();
        let e = read_f32_reply(&mut wire.as_slice()).unwrap().expect_err("an error reply");
        assert_eq!(e.to_string(), "rank 2 timed out in all_gather");
        let mut short = Msg::default().u8(0).u64(3);
        short.0.extend_from_slice(&1f32.to_le_bytes());
        let mut wire = vec![];
        write_frame(&mut wire, &short.0).unwrap();
        let e = read_f32_reply(&mut wire.as_slice()).unwrap().expect_err("a count of 3 with one value");
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    fn env(rank: usize, world: usize, port: u16) -> DistEnv {
        DistEnv { rank, world_size: world, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port, launcher: "test" }
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn ranks_over_sockets_compute_like_local_ranks() {
        let port = free_port();
        let handles: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    let (g, _) = connect(&env(r, 3, port), 3, Duration::from_secs(20)).unwrap();
                    let gathered = g.world.all_gather(&[r as f32]).unwrap();
                    let rs = g.shard.reduce_scatter(&[1.0, 2.0, 3.0]).unwrap();
                    let mut x = [r as f64 + 0.5];
                    g.world.all_reduce_f64(&mut x).unwrap();
                    let sc = g.world.scatter(0, (r == 0).then(|| vec![vec![7.0], vec![8.0], vec![9.0]])).unwrap();
                    let b = g.world.broadcast_bytes(0, (r == 0).then(|| b"hi".to_vec())).unwrap();
                    g.world.barrier().unwrap();
                    (gathered, rs, x[0], sc, b)
                })
            })
            .collect();
        for (r, h) in handles.into_iter().enumerate() {
            let (gathered, rs, x, sc, b) = h.join().unwrap();
            assert_eq!(gathered, vec![0.0, 1.0, 2.0]);
            assert_eq!(rs, vec![3.0 * (r as f32 + 1.0)]);
            assert_eq!(x, 4.5);
            assert_eq!(sc, vec![7.0 + r as f32]);
            assert_eq!(b, b"hi");
        }
    }

    #[test]
    fn a_rank_that_never_joins_is_named() {
        let port = free_port();
        let err = connect(&env(0, 2, port), 2, Duration::from_millis(300)).err().unwrap();
        assert!(err.to_string().contains("rank(s) [1] did not join"), "{err}");
    }
}
