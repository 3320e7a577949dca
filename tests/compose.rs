//! `docker-compose.yml` cannot be run here (no Docker engine), so its
//! structure is checked instead: the services exist and depend on each
//! other as documented, every skein command parses with the real binary,
//! the mounted config exists and loads with the environment compose gives
//! it. This proves the file is consistent, not that it runs.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_yaml_ng::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn compose() -> Value {
    serde_yaml_ng::from_str(&std::fs::read_to_string(root().join("docker-compose.yml")).unwrap())
        .expect("docker-compose.yml is YAML")
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().map(|x| x.as_str().unwrap().to_string()).collect())
        .unwrap_or_default()
}

#[test]
fn compose_services_and_dependencies() {
    let c = compose();
    let services = c["services"].as_mapping().expect("services");
    let names: Vec<&str> = services.keys().map(|k| k.as_str().unwrap()).collect();
    for want in [
        "kafka",
        "postgres",
        "skein-setup",
        "skein-extract",
        "skein-apply-1",
        "skein-apply-2",
    ] {
        assert!(names.contains(&want), "service {want} missing: {names:?}");
    }
    assert!(strs(&c["services"]["postgres"]["command"]).contains(&"wal_level=logical".to_string()));
    assert_eq!(
        c["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"], "broker,controller",
        "Kafka runs in KRaft mode"
    );
    for svc in ["skein-extract", "skein-apply-1", "skein-apply-2"] {
        let deps = &c["services"][svc]["depends_on"];
        assert_eq!(deps["kafka"]["condition"], "service_healthy", "{svc}");
        assert_eq!(
            deps["skein-setup"]["condition"], "service_completed_successfully",
            "{svc}"
        );
    }
    // Each applier has its own static member id.
    let ids: Vec<String> = ["skein-apply-1", "skein-apply-2"]
        .iter()
        .map(|s| strs(&c["services"][*s]["command"]).last().unwrap().clone())
        .collect();
    assert_ne!(ids[0], ids[1]);
}

#[test]
fn compose_skein_commands_parse_and_the_config_loads() {
    let c = compose();
    let services = c["services"].as_mapping().unwrap();
    let mut checked = 0;
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        if !name.starts_with("skein-") {
            continue;
        }
        // The environment compose gives the process (anchors resolved by the parser).
        let env: BTreeMap<String, String> = svc["environment"]
            .as_mapping()
            .unwrap_or_else(|| panic!("{name}: environment"))
            .iter()
            .map(|(k, v)| (k.as_str().unwrap().into(), v.as_str().unwrap().into()))
            .collect();
        // The mounted config is the repository's file.
        let mount = strs(&svc["volumes"])
            .into_iter()
            .find(|v| v.ends_with(":/etc/skein/skein.yaml:ro"))
            .unwrap_or_else(|| panic!("{name}: config mount"));
        let host = root().join(mount.split(':').next().unwrap());
        assert!(host.exists(), "{name}: {} missing", host.display());
        // `skein validate` would connect; `sql sidecar` only loads the config,
        // which expands every ${VAR} and checks every field.
        let out = Command::new(env!("CARGO_BIN_EXE_skein"))
            .args(["sql", "sidecar", "--config"])
            .arg(&host)
            .env_clear()
            .envs(&env)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: the config does not load with compose's environment: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The command line parses (`--help` after it parses everything before).
        let cmd = strs(&svc["command"]);
        if !cmd.is_empty() {
            let out = Command::new(env!("CARGO_BIN_EXE_skein"))
                .args(&cmd)
                .arg("--help")
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: `skein {}` does not parse: {}",
                cmd.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        checked += 1;
    }
    assert!(checked >= 4, "skein services checked: {checked}");
}
