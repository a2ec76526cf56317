//! TLS for the gateway's public port and the worker's outbound link (rustls with the ring
//! provider): a certificate from PEM files, or a self-signed one for dev, and a client that
//! trusts either the web's roots or one given CA.

use std::io::BufReader;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let certs = rustls_pemfile::certs(&mut BufReader::new(file))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading PEM certificates from {}", path.display()))?;
    if certs.is_empty() {
        bail!("{} holds no PEM certificate", path.display());
    }
    Ok(certs)
}

fn server(
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<ServerConfig>> {
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("certificate and key do not form a usable TLS identity")?;
    Ok(Arc::new(config))
}

/// A server identity from PEM files.
pub fn server_from_files(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>> {
    let file = std::fs::File::open(key).with_context(|| format!("opening {}", key.display()))?;
    let key = rustls_pemfile::private_key(&mut BufReader::new(file))
        .with_context(|| format!("reading a PEM private key from {}", key.display()))?
        .with_context(|| format!("{} holds no PEM private key", key.display()))?;
    server(read_certs(cert)?, key)
}

/// A fresh self-signed identity for `localhost` and 127.0.0.1; its certificate is written
/// to `cert_out` so that clients can pass it as their CA.
pub fn self_signed(cert_out: &Path) -> Result<Arc<ServerConfig>> {
    let names = vec!["localhost".to_string(), "127.0.0.1".to_string()];
    let certified =
        rcgen::generate_simple_self_signed(names).context("generating a certificate")?;
    std::fs::write(cert_out, certified.cert.pem())
        .with_context(|| format!("writing {}", cert_out.display()))?;
    let key = PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    server(vec![certified.cert.der().clone()], key)
}

/// A client trusting `ca` when given (a dev gateway's self-signed certificate), else the
/// web's usual roots.
pub fn client(ca: Option<&Path>) -> Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            for cert in read_certs(path)? {
                roots.add(cert).with_context(|| {
                    format!("{} is not a usable CA certificate", path.display())
                })?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(config))
}
