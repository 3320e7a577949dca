//! `docker-compose.yml` cannot be run here (no Docker engine, no compose
//! tool), so its structure is checked instead: it validates against the
//! Compose Specification schema (`tests/fixtures/compose_spec.json`), the
//! services exist and depend on each other as documented, every skein
//! command parses with the real binary, the mounted config exists and loads
//! with the environment compose gives it. This proves the file is
//! consistent, not that it runs.

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
fn compose_file_follows_the_compose_specification() {
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/compose_spec.json")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).expect("the Compose schema compiles");
    // YAML → JSON (anchors resolved), as compose reads it.
    let doc: serde_json::Value = serde_json::to_value(compose()).unwrap();
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "docker-compose.yml: {errors:#?}");
    // The validator does reject what compose rejects.
    let mut bad = doc.clone();
    bad["services"]["apply"]["depends_on"]["kafka"]["condition"] = "service_ready".into();
    bad["services"]["relay"]["restart_policy"] = "always".into();
    assert!(validator.iter_errors(&bad).count() >= 2);
}

#[test]
fn compose_services_and_dependencies() {
    let c = compose();
    let services = c["services"].as_mapping().expect("services");
    let names: Vec<&str> = services.keys().map(|k| k.as_str().unwrap()).collect();
    for want in [
        "sqlserver",
        "sqlserver-init",
        "kafka",
        "postgres",
        "skein-setup",
        "extract",
        "apply",
        "relay",
    ] {
        assert!(names.contains(&want), "service {want} missing: {names:?}");
    }
    let ms = &c["services"]["sqlserver"];
    assert!(ms["image"].as_str().unwrap().contains("mssql/server:2022"));
    assert_eq!(
        ms["environment"]["MSSQL_AGENT_ENABLED"], "true",
        "CDC's capture job needs SQL Server Agent"
    );
    // The init container creates the sample database from the repository's schema.
    let init = &c["services"]["sqlserver-init"];
    assert_eq!(
        init["depends_on"]["sqlserver"]["condition"],
        "service_healthy"
    );
    let mount = strs(&init["volumes"]).join(" ");
    assert!(mount.contains("schema.sqlserver.sql"), "{mount}");
    assert!(root()
        .join("examples/quickstart/schema.sqlserver.sql")
        .exists());
    assert!(strs(&init["entrypoint"])
        .join(" ")
        .contains("CREATE DATABASE crm"));
    // Setup enables CDC after the database exists, then creates the sidecar.
    let setup = &c["services"]["skein-setup"];
    assert_eq!(
        setup["depends_on"]["sqlserver-init"]["condition"],
        "service_completed_successfully"
    );
    let script = strs(&setup["entrypoint"]).join(" ");
    assert!(
        script.contains("skein sql source --apply") && script.contains("skein sidecar migrate")
    );
    assert_eq!(
        c["services"]["kafka"]["environment"]["KAFKA_PROCESS_ROLES"], "broker,controller",
        "Kafka runs in KRaft mode"
    );
    for svc in ["extract", "apply", "relay"] {
        let deps = &c["services"][svc]["depends_on"];
        assert_eq!(deps["kafka"]["condition"], "service_healthy", "{svc}");
        assert_eq!(
            deps["skein-setup"]["condition"], "service_completed_successfully",
            "{svc}"
        );
    }
    // `--scale apply=3` needs replicas that do not clash: no fixed container
    // name, no static member id, no published port.
    let apply = &c["services"]["apply"];
    assert!(apply.get("container_name").is_none());
    assert!(apply.get("ports").is_none());
    assert_eq!(strs(&apply["command"]), vec!["apply".to_string()]);
    assert!(!apply["environment"]
        .as_mapping()
        .unwrap()
        .contains_key("SKEIN_INSTANCE_ID"));
    assert_eq!(
        strs(&c["services"]["relay"]["command"]),
        vec!["relay".to_string()]
    );
    // Only the extractor keeps state.
    assert!(strs(&c["services"]["extract"]["volumes"])
        .iter()
        .any(|v| v.starts_with("skein-state:")));
}

/// The commands inside `sh -c` scripts (`skein …` segments joined by `&&`).
fn script_commands(script: &str) -> Vec<Vec<String>> {
    script
        .split("&&")
        .filter_map(|part| {
            let words: Vec<String> = part.split_whitespace().map(String::from).collect();
            (words.first().map(String::as_str) == Some("skein")).then(|| words[1..].to_vec())
        })
        .collect()
}

#[test]
fn compose_skein_commands_parse_and_the_config_loads() {
    let c = compose();
    let services = c["services"].as_mapping().unwrap();
    let mut checked = 0;
    for (name, svc) in services {
        let name = name.as_str().unwrap();
        if svc["image"].as_str() != Some("skein:local") {
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
        // The command lines parse (`--help` after them parses everything
        // before it): the service's command, and the skein commands of an
        // entrypoint script.
        let mut cmds = script_commands(&strs(&svc["entrypoint"]).join(" "));
        cmds.push(strs(&svc["command"]));
        for cmd in cmds.into_iter().filter(|c| !c.is_empty()) {
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
    assert!(checked >= 7, "skein services checked: {checked}");
}
