//! Connecting to PostgreSQL, the one place that reads a connection URL:
//! queries (`tokio-postgres`) and the replication stream
//! (`pgwire-replication`) both honour `sslmode` and `sslrootcert` as libpq
//! does, over rustls.
//!
//! | `sslmode`     | TLS                          | certificate checked         |
//! |---------------|------------------------------|-----------------------------|
//! | `disable`     | never                        | —                           |
//! | `prefer`      | if the server offers it      | no                          |
//! | `require`     | always                       | no                          |
//! | `verify-ca`   | always                       | chain to `sslrootcert`      |
//! | `verify-full` | always                       | chain and the host name     |
//!
//! The default is `prefer`, as libpq's. Without `sslrootcert`, `verify-ca`
//! and `verify-full` check against the system's trusted roots.
//!
//! Every connection also fixes the session's value formats
//! ([`SESSION_FORMATS`]), whatever the server, database or role set: keys
//! travel as text (pgoutput sends values in the walsender session's
//! `DateStyle` and `TimeZone`; lookups and hydration cast them to `text`
//! and back), so every session must render a timestamp the same way.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use pgwire_replication::TlsConfig;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres_rustls::MakeRustlsConnect;

/// The value formats of every skein session, source and sidecar, query and
/// replication: `(setting, value)`. A key read from the change stream is
/// parsed by hydration and compared with keys looked up in the source; a
/// database set to `DateStyle = 'SQL, DMY'` once made hydration fail on
/// `13/07/2024`, and a `TimeZone` other than UTC made a `timestamptz` key's
/// text depend on the session.
pub const SESSION_FORMATS: [(&str, &str); 4] = [
    ("TimeZone", "UTC"),
    ("DateStyle", "ISO,YMD"),
    ("IntervalStyle", "iso_8601"),
    ("extra_float_digits", "1"),
];

/// [`SESSION_FORMATS`] as `SET` statements, run on every query connection
/// right after it opens (a connection pooler may refuse startup `options`;
/// every server takes a `SET`).
pub fn session_formats_sql() -> String {
    SESSION_FORMATS
        .iter()
        .map(|(k, v)| format!("SET {k} = '{v}'"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The startup `options` of the replication connection: the URL's own
/// `options`, then [`SESSION_FORMATS`] (the last `-c` of a setting wins, so
/// ours do). A walsender runs no `SET` before it streams: this is the only
/// way to fix the formats pgoutput renders values in.
pub fn replication_options(url_options: Option<&str>) -> String {
    let ours = SESSION_FORMATS
        .iter()
        .map(|(k, v)| format!("-c {k}={v}"))
        .collect::<Vec<_>>()
        .join(" ");
    match url_options.map(str::trim).filter(|o| !o.is_empty()) {
        Some(theirs) => format!("{theirs} {ours}"),
        None => ours,
    }
}

/// libpq's `sslmode`, the values skein supports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// TLS if the server offers it, unchecked.
    #[default]
    Prefer,
    /// TLS, unchecked.
    Require,
    /// TLS, certificate chain checked.
    VerifyCa,
    /// TLS, certificate chain and host name checked.
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = ConnectError;

    fn from_str(s: &str) -> Result<Self, ConnectError> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(ConnectError::Settings(format!(
                    "sslmode `{other}` is not supported: use disable, prefer, require, \
                     verify-ca or verify-full"
                )))
            }
        })
    }
}

/// A connection URL with its TLS settings taken out.
#[derive(Clone, Debug)]
pub struct PgUrl {
    /// Everything but the TLS settings.
    pub config: tokio_postgres::Config,
    /// `sslmode`.
    pub ssl_mode: SslMode,
    /// `sslrootcert`: the PEM file of the trusted CA certificates.
    pub root_cert: Option<PathBuf>,
}

/// Why a connection could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The URL or its TLS settings are wrong (bad `sslmode`, unreadable
    /// `sslrootcert`): a person has to fix the configuration.
    #[error("{0}")]
    Settings(String),
    /// The server could not be reached (worth trying again).
    #[error("{0}")]
    Unreachable(String),
    /// The server could not be reached, refused us, or TLS failed.
    #[error("{}", with_cause(.0))]
    Db(#[source] tokio_postgres::Error),
}

impl ConnectError {
    /// Whether trying again later may succeed: the server was unreachable
    /// or closed the connection. Bad settings, a refused login and a
    /// certificate that does not verify stay wrong until someone acts.
    pub fn is_retryable(&self) -> bool {
        match self {
            ConnectError::Settings(_) => false,
            ConnectError::Unreachable(_) => true,
            ConnectError::Db(e) => e.as_db_error().is_none() && !is_tls_failure(e),
        }
    }
}

/// A handshake that failed on the certificate (unknown issuer, wrong name).
fn is_tls_failure(e: &tokio_postgres::Error) -> bool {
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        // An io::Error hides the error it wraps from `source()`.
        let inner = c
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .map(|i| i as &(dyn std::error::Error + 'static));
        if c.downcast_ref::<rustls::Error>().is_some()
            || inner.is_some_and(|i| i.downcast_ref::<rustls::Error>().is_some())
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// tokio-postgres prints "error performing TLS handshake" and keeps the
/// reason (unknown issuer, name mismatch) in its source: show both.
fn with_cause(e: &tokio_postgres::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

impl PgUrl {
    /// Parses a URL (`postgres://…?sslmode=…&sslrootcert=…`) or a libpq
    /// key/value string (`host=… sslmode=…`).
    pub fn parse(url: &str) -> Result<PgUrl, ConnectError> {
        let mut ssl_mode = None;
        let mut root_cert = None;
        let mut take = |k: &str, v: &str| -> Result<bool, ConnectError> {
            match k {
                "sslmode" => ssl_mode = Some(v.parse::<SslMode>()?),
                "sslrootcert" => root_cert = Some(PathBuf::from(v)),
                _ => return Ok(false),
            }
            Ok(true)
        };
        let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            // The query is filtered as written, never re-encoded: tokio-postgres
            // decodes only `%XX` (a re-encoded space would read as `+`), and
            // a URL of several hosts is no `url::Url`.
            match url.split_once('?') {
                None => url.to_string(),
                Some((base, query)) => {
                    let mut kept = vec![];
                    for seg in query.split('&') {
                        let (k, v) = seg.split_once('=').unwrap_or((seg, ""));
                        if !take(&percent_decode(k)?, &percent_decode(v)?)? {
                            kept.push(seg);
                        }
                    }
                    if kept.is_empty() {
                        base.to_string()
                    } else {
                        format!("{base}?{}", kept.join("&"))
                    }
                }
            }
        } else {
            let mut kept = vec![];
            for word in url.split_whitespace() {
                let used = match word.split_once('=') {
                    Some((k, v)) => take(k.trim(), v.trim().trim_matches('\''))?,
                    None => false,
                };
                if !used {
                    kept.push(word);
                }
            }
            // `sslmode = require` (spaces around `=`) is valid libpq; read
            // wrongly it would fall back to `prefer`. Refuse it instead.
            if kept
                .iter()
                .any(|w| w.starts_with("sslmode") || w.starts_with("sslrootcert"))
            {
                return Err(ConnectError::Settings(
                    "write `sslmode=VALUE` and `sslrootcert=PATH` without spaces around `=` \
                     in the connection string"
                        .into(),
                ));
            }
            kept.join(" ")
        };
        let mut config = tokio_postgres::Config::from_str(&rest)
            .map_err(|e| ConnectError::Settings(format!("the connection URL is invalid: {e}")))?;
        let ssl_mode = ssl_mode.unwrap_or_default();
        config.ssl_mode(match ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        Ok(PgUrl {
            config,
            ssl_mode,
            root_cert,
        })
    }

    /// The rustls client configuration of this `sslmode`.
    pub fn rustls_config(&self) -> Result<ClientConfig, ConnectError> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let checked = matches!(self.ssl_mode, SslMode::VerifyCa | SslMode::VerifyFull);
        let roots = if checked {
            self.roots()?
        } else {
            RootCertStore::empty()
        };
        let roots = Arc::new(roots);
        let mut cfg = ClientConfig::builder()
            .with_root_certificates(roots.clone())
            .with_no_client_auth();
        let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        let verifier: Option<Arc<dyn ServerCertVerifier>> = match self.ssl_mode {
            SslMode::VerifyFull => None,
            SslMode::VerifyCa => Some(Arc::new(Relaxed {
                chain: Some(
                    WebPkiServerVerifier::builder(roots)
                        .build()
                        .map_err(|e| ConnectError::Settings(format!("TLS verifier: {e}")))?,
                ),
                algorithms,
            })),
            _ => Some(Arc::new(Relaxed {
                chain: None,
                algorithms,
            })),
        };
        if let Some(v) = verifier {
            cfg.dangerous().set_certificate_verifier(v);
        }
        Ok(cfg)
    }

    fn roots(&self) -> Result<RootCertStore, ConnectError> {
        let mut roots = RootCertStore::empty();
        match &self.root_cert {
            Some(path) => {
                let certs = CertificateDer::pem_file_iter(path)
                    .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| {
                        ConnectError::Settings(format!("sslrootcert {}: {e}", path.display()))
                    })?;
                if certs.is_empty() {
                    return Err(ConnectError::Settings(format!(
                        "sslrootcert {}: no certificate in the file",
                        path.display()
                    )));
                }
                for c in certs {
                    roots.add(c).map_err(|e| {
                        ConnectError::Settings(format!("sslrootcert {}: {e}", path.display()))
                    })?;
                }
            }
            None => {
                for c in rustls_native_certs::load_native_certs().certs {
                    let _ = roots.add(c);
                }
            }
        }
        Ok(roots)
    }

    /// The replication connection of slot `slot` on publication
    /// `publication`: the same server, role, database, `options` and TLS
    /// as the queries'. Positions and intervals are the caller's.
    pub async fn replication_config(
        &self,
        slot: &str,
        publication: &str,
    ) -> Result<pgwire_replication::ReplicationConfig, ConnectError> {
        let pg = &self.config;
        let host = match pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".to_string(),
        };
        let password = pg
            .get_password()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .unwrap_or_default();
        Ok(pgwire_replication::ReplicationConfig::new(
            host,
            pg.get_user().unwrap_or("postgres"),
            password,
            pg.get_dbname().unwrap_or("postgres"),
            slot,
            publication,
        )
        .with_port(pg.get_ports().first().copied().unwrap_or(5432))
        .with_options(self.replication_options())
        .with_tls(self.replication_tls().await?))
    }

    /// The replication connection's TLS settings, the same as the queries'.
    ///
    /// `verify-ca` checks the certificate chain and not the name. The
    /// replication client's own `verify-ca` (pgwire-replication 0.5) also
    /// rejects a certificate whose names do not include the host, on the
    /// rustls in use. So for `verify-ca` the certificate is fetched first,
    /// its chain checked here ([`PgUrl::server_cert_name`]), and the stream
    /// then names the server by a DNS name of that certificate: the
    /// client's check (chain and name) passes exactly when the chain does.
    pub async fn replication_tls(&self) -> Result<TlsConfig, ConnectError> {
        let host = match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => Some(h.clone()),
            _ => None,
        };
        let mut tls = match self.ssl_mode {
            SslMode::Disable => TlsConfig::disabled(),
            SslMode::Prefer => TlsConfig {
                mode: pgwire_replication::SslMode::Prefer,
                ..TlsConfig::disabled()
            },
            SslMode::Require => TlsConfig::require(),
            SslMode::VerifyCa => TlsConfig::verify_ca(self.root_cert.clone()),
            SslMode::VerifyFull => TlsConfig::verify_full(self.root_cert.clone()),
        };
        let name = match self.ssl_mode {
            SslMode::VerifyCa => self.server_cert_name().await?.or(host),
            // An IP address is checked against the certificate's IP names,
            // as the queries' connection does.
            _ => host,
        };
        if let Some(n) = name {
            tls = tls.with_sni_hostname(n);
        }
        Ok(tls)
    }

    /// The first DNS name of the server's certificate, fetched over a TLS
    /// handshake that checks the chain as this `sslmode` says (`None`: the
    /// certificate has no DNS name, or the server is not on TCP).
    pub async fn server_cert_name(&self) -> Result<Option<String>, ConnectError> {
        // A peer that accepts and never answers (a balancer whose backend is
        // down) must not hang the extractor: bounded like a connection.
        let within = self
            .config
            .get_connect_timeout()
            .copied()
            .unwrap_or(std::time::Duration::from_secs(30));
        tokio::time::timeout(within, self.fetch_cert_name())
            .await
            .unwrap_or_else(|_| {
                Err(ConnectError::Unreachable(format!(
                    "fetching the server certificate: no answer within {within:?}"
                )))
            })
    }

    async fn fetch_cert_name(&self) -> Result<Option<String>, ConnectError> {
        let Some(tokio_postgres::config::Host::Tcp(host)) = self.config.get_hosts().first() else {
            return Ok(None);
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        let io = |e: std::io::Error| {
            ConnectError::Unreachable(format!(
                "fetching the server certificate from {host}:{port}: {e}"
            ))
        };
        let mut tcp = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(io)?;
        // SSLRequest: length 8, code 80877103; the server answers S or N.
        tcp.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
            .await
            .map_err(io)?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer).await.map_err(io)?;
        if answer[0] != b'S' {
            return Err(ConnectError::Settings(format!(
                "sslmode={:?} but the server at {host}:{port} does not support TLS",
                self.ssl_mode
            )));
        }
        let name = ServerName::try_from(host.clone())
            .map_err(|e| ConnectError::Settings(format!("host name {host}: {e}")))?;
        let tls = tokio_rustls::TlsConnector::from(Arc::new(self.rustls_config()?))
            .connect(name, tcp)
            .await
            .map_err(|e| {
                ConnectError::Settings(format!("TLS handshake with {host}:{port}: {e}"))
            })?;
        let cert = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
        Ok(cert.and_then(|der| {
            webpki::EndEntityCert::try_from(der)
                .ok()?
                .valid_dns_names()
                .next()
                .map(str::to_string)
        }))
    }

    /// Opens a query connection with [`SESSION_FORMATS`] set; its task is
    /// spawned and ends when the client is dropped.
    pub async fn connect(
        &self,
        what: &'static str,
    ) -> Result<tokio_postgres::Client, ConnectError> {
        let hosts = self.config.get_hosts();
        let unix_only = !hosts.is_empty()
            && !hosts
                .iter()
                .any(|h| matches!(h, tokio_postgres::config::Host::Tcp(_)));
        let client = if unix_only {
            let mut plain = self.config.clone();
            plain.ssl_mode(tokio_postgres::config::SslMode::Disable);
            let (client, conn) = plain
                .connect(tokio_postgres::NoTls)
                .await
                .map_err(ConnectError::Db)?;
            tokio::spawn(log_close(conn, what));
            client
        } else {
            let tls = MakeRustlsConnect::new(self.rustls_config()?);
            let (client, conn) = self.config.connect(tls).await.map_err(ConnectError::Db)?;
            tokio::spawn(log_close(conn, what));
            client
        };
        client
            .batch_execute(&session_formats_sql())
            .await
            .map_err(ConnectError::Db)?;
        Ok(client)
    }

    /// The startup `options` of the replication connection
    /// ([`replication_options`] of this URL's `options`).
    pub fn replication_options(&self) -> String {
        replication_options(self.config.get_options())
    }
}

/// Drives a connection until it closes; logs why it did.
async fn log_close<F>(conn: F, what: &'static str)
where
    F: std::future::Future<Output = Result<(), tokio_postgres::Error>>,
{
    if let Err(e) = conn.await {
        tracing::debug!(error = %e, "{what} connection closed");
    }
}

/// Decodes the `%XX` escapes of a connection URL's query (as libpq and
/// tokio-postgres do: `+` stays `+`).
fn percent_decode(s: &str) -> Result<String, ConnectError> {
    let bad = || ConnectError::Settings(format!("the connection URL has a bad escape in `{s}`"));
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// The certificate checks of `verify-ca` (`chain`: the chain is checked,
/// the name is not) and of `prefer` / `require` (no `chain`: encrypted, the
/// certificate not checked, libpq's meaning of these modes). The handshake
/// signatures are checked in every mode.
#[derive(Debug)]
struct Relaxed {
    chain: Option<Arc<WebPkiServerVerifier>>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Relaxed {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(chain) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_are_taken_out_of_both_url_forms() {
        let u = PgUrl::parse(
            "postgres://u:p@db.example:5433/app?sslmode=verify-full&sslrootcert=/ca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(u.ssl_mode, SslMode::VerifyFull);
        assert_eq!(u.root_cert, Some(PathBuf::from("/ca.pem")));
        assert_eq!(u.config.get_dbname(), Some("app"));
        assert_eq!(u.config.get_application_name(), Some("x"));
        assert_eq!(
            u.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        let k = PgUrl::parse("host=db user=u sslmode=verify-ca sslrootcert=/ca.pem dbname=app")
            .unwrap();
        assert_eq!(k.ssl_mode, SslMode::VerifyCa);
        assert_eq!(k.config.get_dbname(), Some("app"));
        let d = PgUrl::parse("postgres://u@h/db").unwrap();
        assert_eq!(d.ssl_mode, SslMode::Prefer);
        assert_eq!(d.ssl_mode, SslMode::Prefer);
        let off = PgUrl::parse("postgres://u@h/db?sslmode=disable").unwrap();
        assert_eq!(
            off.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        assert_eq!(off.ssl_mode, SslMode::Disable);
    }

    #[test]
    fn every_session_gets_the_same_formats_and_ours_win() {
        assert_eq!(
            session_formats_sql(),
            "SET TimeZone = 'UTC'; SET DateStyle = 'ISO,YMD'; \
             SET IntervalStyle = 'iso_8601'; SET extra_float_digits = '1'"
        );
        let ours = "-c TimeZone=UTC -c DateStyle=ISO,YMD -c IntervalStyle=iso_8601 \
                    -c extra_float_digits=1";
        assert_eq!(
            PgUrl::parse("postgres://u@h/db")
                .unwrap()
                .replication_options(),
            ours
        );
        let u = PgUrl::parse("host=h options='-c\\ work_mem=1MB'").unwrap();
        let theirs = u.config.get_options().unwrap().to_string();
        assert_eq!(u.replication_options(), format!("{theirs} {ours}"));
        // No value needs quoting in the startup packet (a space would).
        assert!(SESSION_FORMATS
            .iter()
            .all(|(k, v)| !k.contains(' ') && !v.contains(' ')));
    }

    #[test]
    fn a_wrong_sslmode_or_root_cert_is_a_clear_error() {
        let e = PgUrl::parse("postgres://u@h/db?sslmode=verify_full").unwrap_err();
        assert!(e.to_string().contains("verify-full"), "{e}");
        assert!(!e.is_retryable());
        // Kept parameters stay as written: `%20` is not re-encoded as `+`.
        let o = PgUrl::parse("postgres://u@h/db?options=-c%20x%3Dy&sslmode=require").unwrap();
        assert_eq!(o.config.get_options(), Some("-c x=y"));
        assert_eq!(o.ssl_mode, SslMode::Require);
        let root = PgUrl::parse("postgres://u@h/db?sslmode=verify-ca&sslrootcert=%2Fetc%2Fca.pem")
            .unwrap();
        assert_eq!(root.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        // Several hosts, as libpq and tokio-postgres take them.
        let many = PgUrl::parse("postgres://u@h1:5432,h2:5433/db?sslmode=require").unwrap();
        assert_eq!(many.config.get_hosts().len(), 2);
        // Never a silent fall back to `prefer`.
        let e = PgUrl::parse("host=h sslmode = require").unwrap_err();
        assert!(e.to_string().contains("sslmode=VALUE"), "{e}");
        let q = PgUrl::parse("host=h sslmode='require'").unwrap();
        assert_eq!(q.ssl_mode, SslMode::Require);
        let e = PgUrl::parse("host=h port=notaport").unwrap_err();
        assert!(e.to_string().contains("invalid"), "{e}");
        assert!(!e.is_retryable(), "a bad URL stays bad: {e}");
        let u = PgUrl::parse("postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent.pem")
            .unwrap();
        let e = u.rustls_config().unwrap_err();
        assert!(e.to_string().contains("/nonexistent.pem"), "{e}");
    }
}
