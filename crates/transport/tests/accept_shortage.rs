//! A listener out of file descriptors pauses its accepts instead of spinning.
//!
//! Its own test binary: it lowers this process's RLIMIT_NOFILE, which no other test may see.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use plugreg_proto::example::v1beta1::example_server::{Example, ExampleServer};
use plugreg_proto::example::v1beta1::{ExampleRequest, ExampleResponse};
use plugreg_transport::{bind, serve, server};
use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

struct Echo;

#[tonic::async_trait]
impl Example for Echo {
    async fn get_example_info(
        &self,
        req: Request<ExampleRequest>,
    ) -> Result<Response<ExampleResponse>, Status> {
        Ok(Response::new(ExampleResponse {
            error: req.into_inner().request,
        }))
    }
}

/// CPU time (user + system) this process has used, from /proc/self/stat (clock ticks of 10 ms),
/// read through a file opened beforehand: no descriptor is free when it is needed.
fn cpu_time(file: &mut File) -> Duration {
    file.seek(SeekFrom::Start(0)).unwrap();
    let mut stat = String::new();
    file.read_to_string(&mut stat).unwrap();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<u64> = rest
        .split(' ')
        .skip(11)
        .take(2)
        .map(|x| x.parse().unwrap())
        .collect();
    Duration::from_millis((f[0] + f[1]) * 10)
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn out_of_descriptors_the_listener_pauses_then_serves() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let token = CancellationToken::new();
    let socket = bind(&path).unwrap();
    let router = server().add_service(ExampleServer::new(Echo));
    let server = rt.spawn(serve(router, socket, token.clone().cancelled_owned()));

    // Leave exactly one descriptor free, take it with a client: the server's accept of that
    // client then fails with EMFILE for as long as the table stays full.
    let mut stat = File::open("/proc/self/stat").unwrap();
    let saved = getrlimit(Resource::Nofile);
    let limit = open_fds() + 16;
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(limit),
            maximum: saved.maximum,
        },
    )
    .unwrap();
    let mut fillers = Vec::new();
    while let Ok(f) = File::open("/dev/null") {
        fillers.push(f);
    }
    fillers.pop();
    let mut client = UnixStream::connect(&path).expect("connect with the last descriptor");

    // Old behaviour: tonic retried the failed accept at once, a whole core for as long as the
    // shortage lasted. A pause of 5 ms doubling to 1 s costs next to nothing.
    let (cpu0, t0) = (cpu_time(&mut stat), Instant::now());
    while t0.elapsed() < Duration::from_millis(1500) {
        std::thread::park_timeout(Duration::from_millis(100));
    }
    let burnt = cpu_time(&mut stat) - cpu0;

    // One descriptor back: the pending client is accepted and answered (HTTP/2 SETTINGS).
    drop(fillers.pop());
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    client
        .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .unwrap();
    let mut header = [0u8; 9];
    let read = client.read_exact(&mut header);
    setrlimit(Resource::Nofile, saved).unwrap();
    drop(fillers);

    assert!(
        burnt < Duration::from_millis(400),
        "the listener spun on EMFILE: {burnt:?} of CPU in 1.5 s"
    );
    read.expect("the server answers once a descriptor is free");
    assert_eq!(header[3], 0x4, "first frame is SETTINGS: {header:?}");
    // A graceful stop waits for open connections.
    drop(client);
    token.cancel();
    rt.block_on(server).unwrap().unwrap();
}
