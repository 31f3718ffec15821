//! Cluster configuration: who this process is in the job, and where to meet the others (the
//! sources it reads are listed on [`ClusterSpec`]).

pub(crate) mod auth;
mod key;
pub(crate) mod listen;
pub(crate) use key::check_token;
pub use key::MIN_TOKEN_BYTES;
use key::{is_loopback, job_secret, Secret};

/// The most ranks a job may have. Every rank keeps a connection to every other, so even this
/// many is more than one host's descriptors allow; larger sizes are mistakes (a unit in the
/// wrong place, an unset variable read as a huge number).
pub const MAX_WORLD_SIZE: usize = 1 << 16;
pub mod store;
pub use auth::random_token;

use std::collections::{BTreeMap, HashMap};

use crate::error::{Error, Result};

/// The task types TensorFlow knows.
pub const TASK_TYPES: [&str; 4] = ["chief", "worker", "ps", "evaluator"];

/// What this process is in the job.
///
/// [`ClusterSpec::from_env`] reads, in this order (the first present wins):
///
/// | source | variables |
/// |---|---|
/// | tutti | `TUTTI_RANK`, `TUTTI_WORLD_SIZE`, `TUTTI_LOCAL_RANK`, `TUTTI_MASTER_ADDR` (`host:port`) |
/// | TensorFlow | `TF_CONFIG` (`cluster` with `chief`/`worker`/`ps`/`evaluator` address lists, `task` with `type` and `index`) |
/// | torchrun | `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` |
/// | Open MPI's mpirun | `OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_RANK` |
/// | SLURM's srun | `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` |
///
/// mpirun gives ranks but no meeting point: `MASTER_ADDR` and `MASTER_PORT` (or
/// `TUTTI_MASTER_ADDR`) name it. Under srun they may too; without them the ranks meet on the first
/// host of the step's node list. `TUTTI_TRANSPORT` (`auto`, `tcp`, `shm`, `mpi`) chooses the transport.
///
/// Every connection of a job proves its secret: `token`, else `TUTTI_JOB_TOKEN`, else this
/// user's own secret on one host; a job across hosts without one is refused unless
/// `TUTTI_INSECURE=1` (see [`ClusterSpec::job_key`], which every way of joining applies, to a
/// spec from the environment or one built by hand alike).
///
/// In a TF_CONFIG cluster the collective world is the chief and the workers, in that order (the
/// chief is rank 0; with no chief, worker 0 is the chief, as in TensorFlow). `ps` and `evaluator`
/// tasks are part of the cluster but not of the collective world. The chief's address is the
/// rendezvous; every task listens for its peers on its own listed host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Where the values came from (`tutti`, `TF_CONFIG`, `torchrun`, `mpirun`, `srun`).
    pub source: &'static str,
    /// This process's rank in the collective world (`None` for `ps` and `evaluator` tasks).
    pub rank: Option<usize>,
    /// Ranks in the collective world.
    pub world_size: usize,
    /// Rank among the processes of this host, when the launcher says.
    pub local_rank: Option<usize>,
    /// `host:port` of the rendezvous store (served by rank 0).
    pub rendezvous: String,
    /// The host this process listens on for its peers.
    pub listen_host: String,
    /// TensorFlow task type (`chief`, `worker`, `ps`, `evaluator`; `worker` elsewhere).
    pub task_type: String,
    /// TensorFlow task index.
    pub task_index: usize,
    /// True for the chief (rank 0).
    pub is_chief: bool,
    /// The full cluster by task type (TF_CONFIG), or `worker` → the rendezvous address.
    pub cluster: BTreeMap<String, Vec<String>>,
    /// The job token (at least [`MIN_TOKEN_BYTES`] bytes). `None` (or empty): the rule of
    /// [`ClusterSpec::job_key`] decides when the job connects (`TUTTI_JOB_TOKEN`, this user's
    /// secret on one host, or an error across hosts); never a job without a secret, unless
    /// `TUTTI_INSECURE=1`.
    pub token: Option<String>,
}

impl ClusterSpec {
    /// Resolve from this process's environment. `Ok(None)` when no launcher variables are set.
    pub fn from_env() -> Result<Option<ClusterSpec>> {
        let vars: HashMap<String, String> = std::env::vars().collect();
        ClusterSpec::from_vars(&vars)
    }

    /// True when the environment names a cluster (any launcher's variables are set).
    pub fn env_present() -> bool {
        [
            "TUTTI_RANK",
            "TF_CONFIG",
            "RANK",
            "OMPI_COMM_WORLD_RANK",
            "SLURM_PROCID",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    }

    /// True when an MPI launcher (`mpirun`, `srun`, MPICH's Hydra) started this process and
    /// no variables that [`ClusterSpec::from_env`] reads first (tutti's, `TF_CONFIG`,
    /// torchrun's) are set: where `auto` means the MPI transport in a build that has it.
    pub fn launched_by_mpi() -> bool {
        let first = [
            "TUTTI_RANK",
            "TUTTI_WORLD_SIZE",
            "TF_CONFIG",
            "RANK",
            "WORLD_SIZE",
        ];
        let mpi = ["OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"];
        !first.iter().any(|v| std::env::var_os(v).is_some())
            && mpi.iter().any(|v| std::env::var_os(v).is_some())
    }

    /// Resolve from a set of variables (the environment, or a test's).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Option<ClusterSpec>> {
        // One of a pair without the other is a job set up by hand and half done: an error,
        // not a silent run alone.
        let spec = if vars.contains_key("TUTTI_RANK") || vars.contains_key("TUTTI_WORLD_SIZE") {
            Some(from_ranks(
                vars,
                "tutti",
                ["TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_LOCAL_RANK"],
            )?)
        } else if let Some(tf) = vars.get("TF_CONFIG") {
            Some(from_tf_config(tf)?)
        } else if vars.contains_key("RANK") || vars.contains_key("WORLD_SIZE") {
            // One without the other is a job set up by hand and half done: an error, not a
            // silent run alone.
            Some(from_ranks(
                vars,
                "torchrun",
                ["RANK", "WORLD_SIZE", "LOCAL_RANK"],
            )?)
        } else if vars.contains_key("OMPI_COMM_WORLD_RANK") {
            let names = [
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
            ];
            Some(from_ranks(vars, "mpirun", names)?)
        } else if vars.contains_key("SLURM_PROCID") {
            Some(from_ranks(
                vars,
                "srun",
                ["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"],
            )?)
        } else {
            None
        };
        let Some(spec) = spec else {
            return Ok(None);
        };
        // The rule every way of joining applies (ClusterSpec::job_key), applied here too: a job
        // across hosts without a token fails before it starts, and the spec carries the secret
        // it found (none when TUTTI_INSECURE=1 opted out: joining says so).
        let token = match job_secret(&spec, vars)? {
            Secret::Key(k) => Some(k),
            Secret::Insecure => None,
        };
        Ok(Some(ClusterSpec { token, ..spec }))
    }

    /// The rank, or an error for tasks outside the collective world.
    pub fn collective_rank(&self) -> Result<usize> {
        self.rank.ok_or_else(|| {
            Error::config(format!(
                "{}: task type '{}' takes no part in collectives (only chief and worker tasks do)",
                self.source, self.task_type
            ))
        })
    }
}

fn parse_num(vars: &HashMap<String, String>, name: &str, source: &str) -> Result<Option<usize>> {
    let from = prefix(source);
    match vars.get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            Error::config(format!("{from}{name}='{v}' is not a non-negative integer"))
        }),
    }
}

/// Where the ranks of an `srun` step meet when no `MASTER_ADDR` is set: the first host of the
/// step's node list (`SLURM_STEP_NODELIST`, else `SLURM_JOB_NODELIST` or `SLURM_NODELIST`), on
/// `MASTER_PORT` if given, else 15000 plus the last four digits of `SLURM_JOB_ID` (the port
/// PyTorch Lightning picks), so every rank of the step computes the same address.
fn slurm_rendezvous(vars: &HashMap<String, String>, port: Option<&String>) -> Result<String> {
    let list = [
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
    ]
    .iter()
    .find_map(|v| vars.get(*v).map(|l| (*v, l)));
    let Some((var, list)) = list else {
        return Err(Error::config(
            "srun: no rendezvous address and no node list; set MASTER_ADDR and MASTER_PORT \
             (or TUTTI_MASTER_ADDR=host:port)",
        ));
    };
    let host = first_host(list).ok_or_else(|| {
        Error::config(format!(
            "srun: {var}='{list}' is not a Slurm host list; set MASTER_ADDR and MASTER_PORT"
        ))
    })?;
    let port: u16 = match port {
        Some(p) => p.trim().parse().ok().filter(|&p| p != 0).ok_or_else(|| {
            Error::config(format!("srun: MASTER_PORT='{p}' is not a port number"))
        })?,
        None => {
            let job = vars.get("SLURM_JOB_ID").ok_or_else(|| {
                Error::config("srun: neither MASTER_PORT nor SLURM_JOB_ID is set; set MASTER_PORT")
            })?;
            let id: u64 = job.trim().parse().map_err(|_| {
                Error::config(format!("srun: SLURM_JOB_ID='{job}' is not a number"))
            })?;
            15000 + (id % 10000) as u16
        }
    };
    Ok(format!("{host}:{port}"))
}

/// The first host of a Slurm host list: `node[07-10,12],gpu1` gives `node07`, `a[1,3]-ib` gives
/// `a1-ib`. None for a list that is empty or unbalanced.
fn first_host(list: &str) -> Option<String> {
    // The first entry: up to the first comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    // Each bracketed range (`rack[1-2]-node[01-04]` has two) gives its first number.
    let mut rest = list[..end].trim();
    let mut host = String::new();
    while let Some((prefix, after)) = rest.split_once('[') {
        let (ranges, tail) = after.split_once(']')?;
        let first = ranges.split([',', '-']).next()?.trim();
        if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        host.push_str(prefix);
        host.push_str(first);
        rest = tail;
    }
    host.push_str(rest);
    (!host.is_empty() && !host.contains(['[', ']', ' ', ','])).then_some(host)
}

/// Split `host:port` (IPv6 in brackets), checking the port.
pub fn split_addr(addr: &str, what: &str) -> Result<(String, u16)> {
    let bad = || Error::config(format!("{what}: '{addr}' is not host:port"));
    let (host, port) = addr.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    if port == 0 {
        return Err(Error::config(format!(
            "{what}: '{addr}' has port 0; peers need a fixed port to meet at"
        )));
    }
    Ok((host.to_string(), port))
}

/// How a message about a source's variables starts: the launcher that set them
/// (`torchrun: RANK is set but ...`); tutti's own (`TUTTI_RANK ...`) need no name, and the
/// `tutti` command and the C ABI put their own name first.
fn prefix(source: &str) -> String {
    if source == "tutti" {
        String::new()
    } else {
        format!("{source}: ")
    }
}

fn from_ranks(
    vars: &HashMap<String, String>,
    source: &'static str,
    names: [&str; 3],
) -> Result<ClusterSpec> {
    let from = prefix(source);
    let [rank_v, size_v, local_v] = names;
    let rank = parse_num(vars, rank_v, source)?
        .ok_or_else(|| Error::config(format!("{from}{size_v} is set but {rank_v} is not")))?;
    let world_size = parse_num(vars, size_v, source)?
        .ok_or_else(|| Error::config(format!("{from}{rank_v} is set but {size_v} is not")))?;
    if world_size == 0 {
        return Err(Error::config(format!("{from}{size_v} must be at least 1")));
    }
    if world_size > MAX_WORLD_SIZE {
        return Err(Error::config(format!(
            "{from}{size_v}={world_size} is more ranks than tutti supports \
             ({MAX_WORLD_SIZE}); every rank keeps a connection to every other"
        )));
    }
    if rank >= world_size {
        return Err(Error::config(format!(
            "{from}{rank_v}={rank} is out of range for {size_v}={world_size}"
        )));
    }
    let local_rank = parse_num(vars, local_v, source)?;
    let rendezvous = if let Some(a) = vars.get("TUTTI_MASTER_ADDR") {
        split_addr(a, "TUTTI_MASTER_ADDR")?;
        a.clone()
    } else {
        match (vars.get("MASTER_ADDR"), vars.get("MASTER_PORT")) {
            (Some(h), Some(p)) => {
                let port: u16 = p.trim().parse().ok().filter(|&p| p != 0).ok_or_else(|| {
                    Error::config(format!("{from}MASTER_PORT='{p}' is not a port number"))
                })?;
                let a = format!("{h}:{port}");
                split_addr(&a, &format!("{from}MASTER_ADDR and MASTER_PORT"))?;
                a
            }
            (Some(_), None) => return Err(Error::config(format!("{from}MASTER_ADDR is set but MASTER_PORT is not"))),
            (None, port) if source == "srun" => slurm_rendezvous(vars, port)?,
            _ => {
                return Err(Error::config(format!(
                    "{from}no rendezvous address; set TUTTI_MASTER_ADDR=host:port, or MASTER_ADDR and MASTER_PORT"
                )))
            }
        }
    };
    let (master_host, _) = split_addr(&rendezvous, "rendezvous address")?;
    let listen_host = vars.get("TUTTI_LISTEN_HOST").cloned().unwrap_or_else(|| {
        if is_loopback(&master_host) {
            master_host.clone()
        } else {
            "0.0.0.0".to_string()
        }
    });
    Ok(ClusterSpec {
        source,
        rank: Some(rank),
        world_size,
        local_rank,
        rendezvous: rendezvous.clone(),
        listen_host,
        task_type: if rank == 0 { "chief" } else { "worker" }.into(),
        task_index: rank,
        is_chief: rank == 0,
        cluster: BTreeMap::from([("worker".to_string(), vec![rendezvous])]),
        token: None,
    })
}

/// Parse and check a TF_CONFIG value.
pub fn from_tf_config(text: &str) -> Result<ClusterSpec> {
    let err = |m: String| Error::config(format!("TF_CONFIG: {m}"));
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(format!("not valid JSON ({e})")))?;
    let cluster_v = v
        .get("cluster")
        .ok_or_else(|| err("missing field 'cluster'".into()))?;
    let cluster_o = cluster_v
        .as_object()
        .ok_or_else(|| err("'cluster' must be an object of address lists".into()))?;
    let mut cluster = BTreeMap::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for (ty, list) in cluster_o {
        if !TASK_TYPES.contains(&ty.as_str()) {
            return Err(err(format!(
                "cluster.{ty}: unknown task type (expected chief, worker, ps or evaluator)"
            )));
        }
        let list = list
            .as_array()
            .ok_or_else(|| err(format!("cluster.{ty} must be a list of \"host:port\"")))?;
        let mut addrs = Vec::new();
        for (i, a) in list.iter().enumerate() {
            let field = format!("cluster.{ty}[{i}]");
            let a = a
                .as_str()
                .ok_or_else(|| err(format!("{field} must be a \"host:port\" string")))?;
            split_addr(a, &format!("TF_CONFIG: {field}"))?;
            if let Some(prev) = seen.insert(a.to_string(), field.clone()) {
                return Err(err(format!(
                    "address {a} appears twice ({prev} and {field})"
                )));
            }
            addrs.push(a.to_string());
        }
        cluster.insert(ty.clone(), addrs);
    }
    let chiefs = cluster.get("chief").map_or(0, |c| c.len());
    if chiefs > 1 {
        return Err(err(format!(
            "cluster.chief lists {chiefs} addresses; there is at most one chief"
        )));
    }
    let task = v
        .get("task")
        .ok_or_else(|| err("missing field 'task'".into()))?;
    let task_type = task
        .get("type")
        .and_then(|t| t.as_str())
        .ok_or_else(|| err("task.type is missing or not a string".into()))?
        .to_string();
    let task_index = match task.get("index") {
        None => 0,
        Some(i) => i
            .as_u64()
            .ok_or_else(|| err("task.index must be a non-negative integer".into()))?
            as usize,
    };
    let tasks = cluster
        .get(&task_type)
        .ok_or_else(|| err(format!("task.type '{task_type}' has no list in 'cluster'")))?;
    if task_index >= tasks.len() {
        return Err(err(format!(
            "task.index {task_index} is out of range for the {} '{task_type}' task(s)",
            tasks.len()
        )));
    }
    // The collective world: the chief, then the workers.
    let world: Vec<(&str, usize, &String)> = ["chief", "worker"]
        .iter()
        .flat_map(|ty| {
            cluster
                .get(*ty)
                .into_iter()
                .flatten()
                .enumerate()
                .map(move |(i, a)| (*ty, i, a))
        })
        .collect();
    if world.is_empty() {
        return Err(err("the cluster has no chief and no worker".into()));
    }
    if world.len() > MAX_WORLD_SIZE {
        return Err(err(format!(
            "cluster.chief and cluster.worker list {} tasks, more ranks than tutti supports \
             ({MAX_WORLD_SIZE})",
            world.len()
        )));
    }
    let rank = world
        .iter()
        .position(|(ty, i, _)| *ty == task_type && *i == task_index);
    let own_addr = &tasks[task_index];
    Ok(ClusterSpec {
        source: "TF_CONFIG",
        rank,
        world_size: world.len(),
        local_rank: None,
        rendezvous: world[0].2.clone(),
        listen_host: split_addr(own_addr, "TF_CONFIG")?.0,
        is_chief: rank == Some(0),
        task_type,
        task_index,
        cluster,
        token: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn tf_config_valid() {
        let tf = r#"{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]},
                     "task": {"type": "worker", "index": 1}}"#;
        let s = from_tf_config(tf).unwrap();
        assert_eq!((s.rank, s.world_size, s.is_chief), (Some(2), 3, false));
        assert_eq!(s.rendezvous, "h0:2222");
        assert_eq!(s.listen_host, "h2");
        let ps = from_tf_config(&tf.replace(
            r#""type": "worker", "index": 1"#,
            r#""type": "ps", "index": 0"#,
        ))
        .unwrap();
        assert_eq!(ps.rank, None);
        assert!(ps
            .collective_rank()
            .unwrap_err()
            .to_string()
            .contains("'ps' takes no part"));
        // No chief: worker 0 is the chief.
        let s = from_tf_config(
            r#"{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        assert!(s.is_chief);
        assert_eq!(s.rendezvous, "a:1");
    }

    #[test]
    fn tf_config_invalid_names_the_field() {
        let cases = [
            ("{not json", "not valid JSON"),
            (r#"{"task": {"type": "worker"}}"#, "missing field 'cluster'"),
            (
                r#"{"cluster": {"worker": ["a:1"]}}"#,
                "missing field 'task'",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 3}}"#,
                "task.index 3 is out of range",
            ),
            (
                r#"{"cluster": {"worker": ["a:1", "a:1"]}, "task": {"type": "worker", "index": 0}}"#,
                "address a:1 appears twice (cluster.worker[0] and cluster.worker[1])",
            ),
            (
                r#"{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}"#,
                "cluster.worker[0]: 'a' is not host:port",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}"#,
                "task.type 'chief' has no list",
            ),
            (
                r#"{"cluster": {"chief": ["a:1", "b:1"]}, "task": {"type": "chief"}}"#,
                "at most one chief",
            ),
            (
                r#"{"cluster": {"boss": ["a:1"]}, "task": {"type": "boss"}}"#,
                "cluster.boss: unknown task type",
            ),
            (
                r#"{"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}"#,
                "no chief and no worker",
            ),
            (
                r#"{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}"#,
                "task.index must be",
            ),
        ];
        for (text, want) in cases {
            let e = from_tf_config(text).unwrap_err().to_string();
            assert!(
                e.contains(want) && e.starts_with("TF_CONFIG: "),
                "{text}: {e}"
            );
        }
    }

    #[test]
    fn launcher_environments() {
        let s = ClusterSpec::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.source, s.rank, s.world_size, s.local_rank),
            ("torchrun", Some(1), 4, Some(1))
        );
        assert_eq!(s.rendezvous, "127.0.0.1:29500");
        assert_eq!(s.listen_host, "127.0.0.1");
        let s = ClusterSpec::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("TUTTI_MASTER_ADDR", "10.0.0.1:5000"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.source, s.rank, s.is_chief), ("mpirun", Some(0), true));
        assert_eq!(s.token.as_deref(), Some("s3cret-s3cret-s3cret"));
        assert_eq!(s.listen_host, "0.0.0.0");
        let s = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("MASTER_ADDR", "n0"),
            ("MASTER_PORT", "7000"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!((s.source, s.rank, s.local_rank), ("srun", Some(3), Some(1)));
        // Slurm sets no MASTER_ADDR: the step's first node, on a port from the job id.
        let s = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_STEP_NODELIST", "gpu[007-008,012],login1"),
            ("SLURM_JOB_ID", "4242137"),
            ("TUTTI_JOB_TOKEN", "s3cret-s3cret-s3cret"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.rendezvous, "gpu007:17137");
        let e = ClusterSpec::from_vars(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_JOB_NODELIST", "n[1-"),
            ("MASTER_PORT", "7000"),
        ]))
        .unwrap_err();
        assert!(e.to_string().contains("SLURM_JOB_NODELIST"), "{e}");
        // tutti's own variables win over the others.
        let s = ClusterSpec::from_vars(&vars(&[
            ("TUTTI_RANK", "0"),
            ("TUTTI_WORLD_SIZE", "1"),
            ("TUTTI_MASTER_ADDR", "127.0.0.1:1"),
            ("RANK", "5"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(s.source, "tutti");
        assert_eq!(ClusterSpec::from_vars(&vars(&[])).unwrap(), None);
    }

    /// Nobody joins a job without its secret (issue 12, item 1): a one-host job that set none
    /// gets this user's private secret; a job across hosts refuses to start without one, unless
    /// the user opts out.
    #[test]
    fn jobs_without_a_token_get_a_secret_or_refuse() {
        use std::os::unix::fs::PermissionsExt;
        let home = std::env::temp_dir().join(format!("tutti-secret-test-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let h = home.to_str().unwrap();
        let torchrun = |addr: &str, extra: &[(&str, &str)]| {
            let mut v = vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", addr),
                ("MASTER_PORT", "29500"),
                ("HOME", h),
            ];
            v.extend_from_slice(extra);
            ClusterSpec::from_vars(&vars(&v))
        };
        let a = torchrun("127.0.0.1", &[]).unwrap().unwrap();
        let b = torchrun("localhost", &[]).unwrap().unwrap();
        let secret = a.token.clone().unwrap();
        assert!(secret.len() >= 32, "{secret}");
        assert_eq!(b.token, a.token, "the user's processes share the secret");
        let file = home.join(".cache/tutti/secret");
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), secret);
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "other users must not read it");
        // A secret file others can read is refused, not used.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = torchrun("127.0.0.1", &[]).unwrap_err().to_string();
        assert!(e.contains("not private"), "{e}");
        // Across hosts: an error that says how to set one, unless TUTTI_INSECURE=1.
        let e = torchrun("10.0.0.7", &[]).unwrap_err().to_string();
        assert!(
            e.contains("TUTTI_JOB_TOKEN") && e.contains("TUTTI_INSECURE=1"),
            "{e}"
        );
        let s = torchrun("10.0.0.7", &[("TUTTI_INSECURE", "1")])
            .unwrap()
            .unwrap();
        assert_eq!(s.token, None);
        let s = torchrun("10.0.0.7", &[("TUTTI_JOB_TOKEN", "given-given-given")])
            .unwrap()
            .unwrap();
        assert_eq!(s.token.as_deref(), Some("given-given-given"));
        std::fs::remove_dir_all(&home).unwrap();
    }

    /// Ranks of one process joining at once race to create the secret: every one gets it.
    #[test]
    fn threads_racing_for_a_fresh_secret_share_it() {
        let home = std::env::temp_dir().join(format!("tutti-secret-race-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        let v = vars(&[("HOME", home.to_str().unwrap())]);
        let got: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..8)
                .map(|_| s.spawn(|| auth::user_secret(&v).unwrap()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(got.iter().all(|t| t == &got[0]), "{got:?}");
        std::fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn launcher_environments_invalid() {
        let cases: [(&[(&str, &str)], &str); 11] = [
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", ""),
                    ("MASTER_PORT", "1"),
                ],
                "torchrun: MASTER_ADDR and MASTER_PORT: ':1' is not host:port",
            ),
            (
                &[
                    ("RANK", "4"),
                    ("WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "1"),
                ],
                "RANK=4 is out of range for WORLD_SIZE=4",
            ),
            (
                &[("RANK", "x"), ("WORLD_SIZE", "4")],
                "RANK='x' is not a non-negative integer",
            ),
            (
                &[
                    ("RANK", "0"),
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "a"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT='99999' is not a port",
            ),
            (
                &[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2")],
                "mpirun: no rendezvous address",
            ),
            (
                &[("SLURM_PROCID", "0")],
                "SLURM_PROCID is set but SLURM_NTASKS is not",
            ),
            (
                &[("RANK", "0")],
                "torchrun: RANK is set but WORLD_SIZE is not",
            ),
            (
                &[("WORLD_SIZE", "2")],
                "torchrun: WORLD_SIZE is set but RANK is not",
            ),
            (
                &[("TUTTI_RANK", "0"), ("TUTTI_WORLD_SIZE", "0")],
                "TUTTI_WORLD_SIZE must be at least 1",
            ),
            (
                &[("TUTTI_WORLD_SIZE", "2")],
                "TUTTI_WORLD_SIZE is set but TUTTI_RANK is not",
            ),
            (
                &[
                    ("TUTTI_RANK", "0"),
                    ("TUTTI_WORLD_SIZE", "2"),
                    ("TUTTI_MASTER_ADDR", "127.0.0.1:0"),
                ],
                "has port 0",
            ),
        ];
        for (v, want) in cases {
            let e = ClusterSpec::from_vars(&vars(v)).unwrap_err().to_string();
            assert!(e.contains(want), "{v:?}: {e}");
            // tutti's own variables need no source name (the caller names itself).
            assert!(!e.starts_with("tutti:"), "{v:?}: {e}");
        }
    }

    #[test]
    fn the_first_host_of_a_slurm_host_list() {
        for (list, first) in [
            ("n0", Some("n0")),
            ("node[07-10,12],gpu1", Some("node07")),
            ("a[1,3]-ib", Some("a1-ib")),
            ("x1,y[2-3]", Some("x1")),
            ("rack[1-2]-node[01-04,07],b", Some("rack1-node01")),
            ("n[1-2]x[", None),
            ("a]b", None),
            ("", None),
            ("n[", None),
            ("n[a-b]", None),
        ] {
            assert_eq!(first_host(list).as_deref(), first, "{list}");
        }
    }
}

/// The parsers of what the environment says (`TF_CONFIG`, the launchers' variables, Slurm host
/// lists, addresses), fed arbitrary text and mutations of valid configurations: each gives a
/// spec within bounds or an error naming the variable or field, never a panic.
#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// Every variable a launcher sets that the parsers read.
    const NAMES: [&str; 23] = [
        "TUTTI_RANK",
        "TUTTI_WORLD_SIZE",
        "TUTTI_LOCAL_RANK",
        "TUTTI_MASTER_ADDR",
        "TUTTI_LISTEN_HOST",
        "TUTTI_JOB_TOKEN",
        "TUTTI_INSECURE",
        "TF_CONFIG",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_STEP_NODELIST",
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_JOB_ID",
    ];

    /// A home of this test process's own, for the per-user secret of one-host jobs.
    fn home() -> &'static str {
        static HOME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        HOME.get_or_init(|| {
            let d = std::env::temp_dir().join(format!("tutti-fuzz-home-{}", std::process::id()));
            std::fs::create_dir_all(&d).unwrap();
            d.to_str().unwrap().to_string()
        })
    }

    /// What a spec the parsers accept satisfies: nothing anyone sizes by it is out of bounds.
    fn within_bounds(s: &ClusterSpec) {
        assert!((1..=MAX_WORLD_SIZE).contains(&s.world_size), "{s:?}");
        assert!(s.rank.is_none_or(|r| r < s.world_size), "{s:?}");
        assert!(split_addr(&s.rendezvous, "rendezvous").is_ok(), "{s:?}");
        assert!(
            s.token.as_ref().is_none_or(|t| t.len() >= MIN_TOKEN_BYTES),
            "{s:?}"
        );
    }

    /// Values that reach the parsers' edges: numbers at and past every bound, addresses,
    /// host lists, JSON fragments, and anything at all.
    fn value() -> impl Strategy<Value = String> {
        prop_oneof![
            2 => any::<String>(),
            1 => "[0-9]{1,3}",
            1 => any::<u64>().prop_map(|n| n.to_string()),
            4 => prop::sample::select(vec![
                "0",
                "1",
                "-1",
                " 2 ",
                "65536",
                "65537",
                "1152921504606846976",
                "18446744073709551616",
                "",
                "1",
                "0x10",
                "127.0.0.1:29500",
                "127.0.0.1:0",
                "[::1]:1",
                ":1",
                "a:b:c",
                "0123456789abcdef0123",
                "short",
                "node[07-10,12],gpu1",
                "n[",
                "rack[1-2]-node[01-04]",
            ])
            .prop_map(String::from),
            2 => "(127\\.0\\.0\\.1|localhost|10\\.0\\.0\\.[0-9]|\\[::1\\]|n[0-9]|)(:[0-9]{0,6})?",
            1 => "[a-z]{0,3}(\\[[0-9,\\-]{0,6}\\]?)?[a-z]{0,2}(,[a-z0-9\\[\\]]{0,5})?",
        ]
    }

    /// A valid environment of one of the launchers (no token: the per-user secret of one
    /// host, or the opt-out across hosts).
    fn launcher_env() -> impl Strategy<Value = HashMap<String, String>> {
        (
            0usize..4,
            1usize..9,
            0usize..8,
            prop::bool::ANY,
            1u16..=u16::MAX,
        )
            .prop_map(|(which, world, rank, local, port)| {
                let rank = (rank % world).to_string();
                let world = world.to_string();
                let host = if local { "127.0.0.1" } else { "10.0.0.1" };
                let mut v: Vec<(&str, String)> = match which {
                    0 => vec![
                        ("TUTTI_RANK", rank),
                        ("TUTTI_WORLD_SIZE", world),
                        ("TUTTI_MASTER_ADDR", format!("{host}:{port}")),
                    ],
                    1 => vec![
                        ("RANK", rank),
                        ("WORLD_SIZE", world),
                        ("LOCAL_RANK", "0".into()),
                        ("MASTER_ADDR", host.into()),
                        ("MASTER_PORT", port.to_string()),
                    ],
                    2 => vec![
                        ("OMPI_COMM_WORLD_RANK", rank),
                        ("OMPI_COMM_WORLD_SIZE", world),
                        ("OMPI_COMM_WORLD_LOCAL_RANK", "0".into()),
                        ("MASTER_ADDR", host.into()),
                        ("MASTER_PORT", port.to_string()),
                    ],
                    _ => vec![
                        ("SLURM_PROCID", rank),
                        ("SLURM_NTASKS", world),
                        ("SLURM_LOCALID", "0".into()),
                        ("SLURM_STEP_NODELIST", "gpu[007-008,012],login1".into()),
                        ("SLURM_JOB_ID", port.to_string()),
                    ],
                };
                // srun's rendezvous is its first node, another host.
                if !local || which == 3 {
                    v.push(("TUTTI_INSECURE", "1".into()));
                }
                v.into_iter().map(|(k, x)| (k.to_string(), x)).collect()
            })
    }

    /// A valid TF_CONFIG, and the rank and world size it describes.
    fn tf_config() -> impl Strategy<Value = (String, Option<usize>, usize)> {
        (0usize..2, 0usize..5, 0usize..3, 0usize..2, 0usize..16, 1u16..1000).prop_filter_map(
            "no chief and no worker",
            |(chiefs, workers, ps, evaluators, pick, port)| {
                if chiefs + workers == 0 {
                    return None;
                }
                let mut n = port;
                let mut list = |k: usize| -> Vec<String> {
                    (0..k)
                        .map(|_| {
                            n += 1;
                            format!("h{n}:{n}")
                        })
                        .collect()
                };
                let cluster = [
                    ("chief", list(chiefs)),
                    ("worker", list(workers)),
                    ("ps", list(ps)),
                    ("evaluator", list(evaluators)),
                ];
                let tasks: Vec<(&str, usize)> = cluster
                    .iter()
                    .flat_map(|(t, l)| (0..l.len()).map(move |i| (*t, i)))
                    .collect();
                let (ty, index) = tasks[pick % tasks.len()];
                let rank = match ty {
                    "chief" => Some(0),
                    "worker" => Some(chiefs + index),
                    _ => None,
                };
                let cluster: serde_json::Map<String, serde_json::Value> = cluster
                    .iter()
                    .filter(|(_, l)| !l.is_empty())
                    .map(|(t, l)| (t.to_string(), serde_json::json!(l)))
                    .collect();
                let text = serde_json::json!({"cluster": cluster, "task": {"type": ty, "index": index}});
                Some((text.to_string(), rank, chiefs + workers))
            },
        )
    }

    /// Mutations of a text: a span replaced by a fragment that reaches an edge.
    fn mutate(text: &str, at: usize, len: usize, with: &str) -> String {
        let mut cut = at % (text.len() + 1);
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut end = (cut + len).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        format!("{}{with}{}", &text[..cut], &text[end..])
    }

    fn fragment() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                "",
                "1152921504606846976",
                "18446744073709551616",
                "-1",
                "1e400",
                "0.5",
                "null",
                "[]",
                "{}",
                "\"\"",
                "\"a:0\"",
                "\"boss\"",
                "\"ps\"",
                "\"chief\"",
                ":",
                ",",
                "[",
                "]",
                "{",
                "}",
                "\"",
                "\\",
                "\"h1:1\",\"h1:1\"",
            ])
            .prop_map(String::from),
            any::<String>(),
        ]
    }

    fn check_tf_config(text: &str) {
        match from_tf_config(text) {
            Ok(s) => {
                within_bounds(&s);
                let tasks = &s.cluster[&s.task_type];
                assert!(s.task_index < tasks.len(), "{s:?}");
                assert!(split_addr(&tasks[s.task_index], "own").is_ok(), "{s:?}");
            }
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with("TF_CONFIG: "), "{text:?}: {e}");
            }
        }
    }

    fn check_vars(vars: &mut HashMap<String, String>) {
        vars.insert("HOME".into(), home().into());
        vars.remove("XDG_RUNTIME_DIR");
        match ClusterSpec::from_vars(vars) {
            Ok(Some(s)) => within_bounds(&s),
            Ok(None) => {}
            Err(e) => {
                let e = e.to_string();
                assert!(
                    NAMES.iter().any(|n| e.contains(n)),
                    "the error names no variable: {vars:?}: {e}"
                );
            }
        }
    }

    proptest! {
        #[test]
        fn tf_config_arbitrary_text(text in any::<String>()) {
            check_tf_config(&text);
        }

        #[test]
        fn tf_config_valid_round_trips((text, rank, world) in tf_config()) {
            let s = from_tf_config(&text).unwrap();
            prop_assert_eq!((s.rank, s.world_size), (rank, world));
            within_bounds(&s);
        }

        #[test]
        fn tf_config_mutations(
            (text, _, _) in tf_config(),
            edits in prop::collection::vec((any::<usize>(), 0usize..8, fragment()), 1..4),
        ) {
            let mut t = text;
            for (at, len, with) in &edits {
                t = mutate(&t, *at, *len, with);
            }
            check_tf_config(&t);
        }

        #[test]
        fn launcher_vars_arbitrary(
            pairs in prop::collection::vec((prop::sample::select(NAMES.to_vec()), value()), 0..8),
        ) {
            let mut vars: HashMap<String, String> =
                pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
            check_vars(&mut vars);
        }

        #[test]
        fn launcher_vars_valid_and_mutated(
            env in launcher_env(),
            edits in prop::collection::vec(
                (
                    any::<prop::sample::Index>(),
                    prop::sample::select(NAMES.to_vec()),
                    prop::option::weighted(0.8, value()),
                ),
                0..3,
            ),
        ) {
            let mut vars = env;
            let valid = edits.is_empty();
            for (i, other, v) in edits {
                // Mostly a variable the launcher set, sometimes another.
                let mut keys: Vec<String> = vars.keys().cloned().collect();
                keys.sort();
                let k = if i.index(4) < 3 { i.get(&keys).clone() } else { other.to_string() };
                match v {
                    Some(v) => vars.insert(k, v),
                    None => vars.remove(&k),
                };
            }
            if valid {
                let mut v = vars.clone();
                v.insert("HOME".into(), home().into());
                let s = ClusterSpec::from_vars(&v).unwrap().unwrap();
                within_bounds(&s);
            }
            check_vars(&mut vars);
        }

        #[test]
        fn slurm_host_lists(list in prop_oneof![
            any::<String>(),
            "[a-z]{0,3}(\\[[0-9,\\-]{0,6}\\]?)?[a-z\\-]{0,2}(\\[[0-9]{0,2}\\])?(,[a-z0-9\\[\\]]{0,5})?",
        ]) {
            if let Some(h) = first_host(&list) {
                prop_assert!(!h.is_empty() && !h.contains(['[', ']', ' ', ',']), "{:?} -> {:?}", list, h);
            }
        }

        #[test]
        fn slurm_host_lists_valid(
            prefix in "[a-z]{1,4}",
            first in 0u32..1000,
            width in 1usize..5,
            more in prop::collection::vec(0u32..1000, 0..3),
            suffix in "(-ib)?",
            tail in "(,[a-z]{1,3}[0-9]?)?",
        ) {
            let first_s = format!("{first:0width$}");
            let mut ranges = first_s.clone();
            for m in &more {
                ranges.push_str(&format!(",{m}-{}", m + 1));
            }
            let list = format!("{prefix}[{ranges}]{suffix}{tail}");
            prop_assert_eq!(first_host(&list), Some(format!("{prefix}{first_s}{suffix}")));
        }

        #[test]
        fn addresses(addr in prop_oneof![any::<String>(), value()]) {
            if let Ok((h, p)) = split_addr(&addr, "x") {
                prop_assert!(!h.is_empty() && p != 0);
            }
        }
    }

    /// Sizes past every bound are refused by the parser, before anything is sized by them.
    #[test]
    fn world_sizes_past_the_bound_are_refused() {
        let huge = (1u64 << 60).to_string();
        for (rank, size) in [("TUTTI_RANK", "TUTTI_WORLD_SIZE"), ("RANK", "WORLD_SIZE")] {
            let v: HashMap<String, String> = [
                (rank, "0"),
                (size, huge.as_str()),
                ("TUTTI_MASTER_ADDR", "127.0.0.1:1"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            let e = ClusterSpec::from_vars(&v).unwrap_err().to_string();
            assert!(e.contains(&format!("{size}={huge} is more ranks")), "{e}");
        }
        let workers: Vec<String> = (0..=MAX_WORLD_SIZE).map(|i| format!("h{i}:1")).collect();
        let tf = serde_json::json!({"cluster": {"worker": workers}, "task": {"type": "worker"}});
        let e = from_tf_config(&tf.to_string()).unwrap_err().to_string();
        assert!(
            e.contains("65537 tasks, more ranks than tutti supports"),
            "{e}"
        );
        let tf = format!(
            r#"{{"cluster": {{"worker": ["a:1"]}}, "task": {{"type": "worker", "index": {huge}}}}}"#
        );
        let e = from_tf_config(&tf).unwrap_err().to_string();
        assert!(
            e.contains("task.index 1152921504606846976 is out of range"),
            "{e}"
        );
    }
}
